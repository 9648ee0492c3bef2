"""End-to-end training (lesson 11): a byte-level transformer trained under FSDP2 in any weight format.

===================  =========================================================================
``data``             real text with no download (``pydoc_data``), byte tokens, fixed split,
                     deterministic and disjoint per-rank batches
``transformer``      the decoder-only model; which linears are quantized, which matmul each format uses
``checkpoints``      where DCP checkpoints live, which one a resume takes
``metrics``          the JSON-lines metrics file, peak memory, state digests
``loop``             ``train_model(TrainConfig)``: meta init -> FSDP2 -> quantized init -> FusedAdam ->
                     FP8 GEMMs or dequantize-on-use -> checkpoints and exact resume -> metrics
``profiling``        where a step's time goes: ``torch.profiler`` over steps of the loop (device busy
                     fraction, host/device time per phase, host syncs, top operators)
``cli``              ``python -m tutorial_lib.train`` (torchrun, one node or many)
===================  =========================================================================

Layer: ``tutorial_lib.train`` sits between ``lessons`` and ``dist | optim``: it puts them together.
"""
