"""Expert parallelism: the token dispatchers (local, all-to-all, DeepEP) and the ParallelStyles that install them.

`dispatcher.py` the stage interface and the local dispatcher, `all_to_all.py` and `deepep_dispatcher.py` the
exchanging ones, `styles.py` the ParallelStyles that shard the routed experts and build a layer's dispatcher.
DeepEP's op layer (custom ops, kernels, buffers) is `distributed/deepep/`.
"""
