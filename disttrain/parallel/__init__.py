"""The mesh and what runs on it: axes, shardings, the sharded TrainState and the step styles.

  mesh         Parallelism: the one object that spells the axes (data, stage, fsdp, expert,
               context, tensor) and their roles; the batch sharding
  sharding     rules -> PartitionSpecs: param_rules regex, else Flax logical axes, then fsdp
  distributed  jax.distributed start-up (roll call, gloo on CPU), agreed stops (SIGTERM, Ctrl-C)
  failures     one process's failure posted to the others, which stop with it at once
  state        TrainState(opt_state, params, mutable, rng, step), created directly sharded
  optim        clipping, optimizer (decay mask, mu dtype), schedule, EMA from the config
  step         the pure pieces of a step: Variant, Policy, loss and grads, update, eval sums
  accumulation gradient accumulation: M micro-batches in a lax.scan, fsdp gathered once
  compiled     Steps: one train entry, a cache of AOT-compiled variants with their memory
  xla_flags    the XLA flags the launcher adds on NVIDIA GPUs, under the user's XLA_FLAGS
  spmd, pmap   one class per step style: jit (GSPMD), shard_map, and the legacy pmap
"""
