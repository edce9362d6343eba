"""The megatron-core actor (student trainer). megatron is imported only inside this package,
and only by `megatron_actor`, `mcore_model`, `attention`, `optimizer`, `checkpointing`, `objective` (TP > 1
across tokenizers) and `cpu_compat` when they run."""
