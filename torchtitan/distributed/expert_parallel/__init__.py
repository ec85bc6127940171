"""Expert parallelism: the token dispatchers (`dispatcher.py`: the stage interface and the local one; `all_to_all.py`
with its ParallelStyles in `styles.py`) and one module per exchange backend holding its dispatcher and the
ParallelStyle that installs it (`deepep_dispatcher.py`, `symm_mem_dispatcher.py`). Their op layers are
`distributed/deepep/` and `distributed/symm_mem_all_to_all.py`.
"""
