"""Optimizers (lessons 07-08): the AdamW reference (``adamw_reference``) and ``FusedAdam``, one
multi-tensor Triton kernel launch per step (``fused_adam``; its per-step plan in ``fused_adam_plan``)."""
