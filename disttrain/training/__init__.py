"""A run from its config: the top layer, which drives every other one.

  setup    setup(): everything before the first step (mesh, data, model, state, steps);
           plan(): its steps over abstract state; run.json
  memory   the memory pre-flight: each step variant's memory, refused over the limit
  batch_size  the largest micro-batch per device whose train step passes the pre-flight
  train_records  step metrics fetched one step late, checked finite, written as train records
  actions  the loop's other periodic actions: Evaluator, Saver, Stopper, Profiler
  loop     train() and evaluate(): the run in its workdir, built up to its first step
  step_loop  the list of what happens each step, its periodic actions, the Result
`disttrain.train` is training.loop.train.
"""
