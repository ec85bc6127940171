"""Expert parallelism: the token dispatchers (`dispatcher.py`: the stage interface and the local one; `all_to_all.py`,
`deepep_dispatcher.py`) and the ParallelStyles that install them (`styles.py`). DeepEP's op layer is
`distributed/deepep/`.
"""
