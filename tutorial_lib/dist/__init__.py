"""Distributed pieces (lessons 00, 05, 06, 10): ranks, meshes, FSDP2 and checkpoints.

===================  =========================================================================
``runtime``          device and backend choice, deterministic CUDA, the environment report
``launcher``         ``launch(fn, world_size)``: N ranks from a notebook, results back, failures loud
``mesh``             ``world_mesh()``: the one 1-D mesh helper a rank function starts with
``fsdp2``            FSDP2 all-gather hooks for every quantized format; shardability checks
``fsdp2_reflatten``  FSDP2's later re-flattens of a shard follow the view scope of its first one
``fsdp2_internals``  the one reader of FSDP2's private per-parameter records (``FSDPParam``)
``quantized_init``   meta-device init that quantizes only each rank's shard
``agreement``        rank-local checks before a collective: every rank goes on, or every rank raises
``checkpoint``       DCP save/load of quantized state (planners, checks, refusals)
``checkpoint_checks`` non-finite and mismatch checks, safe-globals scopes
``checkpoint_dirs``  private checkpoint directories, removed on failure
``extra_state``      quantizer state (delayed-scaling history) as fixed-size ``_extra_state``
``training_state``   ``TrainingState``: model + optimizer + quantizers as one DCP ``Stateful``
``export``           fp32 safetensors export of a sharded quantized model
===================  =========================================================================
"""
