"""Operating a run: what it reports, who watches it, and the guards around it.

  callbacks  Callback hooks, Stop, EarlyStopping, CsvLogger
  metrics    metrics.jsonl, run.json, TensorBoard, console lines, peak FLOPs
  tracking   MLflow and W&B trackers (callbacks): run id in checkpoints, no duplicates
  timing     seconds per phase (the time breakdown), what the loop waits for
  watchdog   the hang watchdog
  events     DIR/events.jsonl: start, restore, end (and the supervisor's exit) per attempt
  goodput    `disttrain goodput`: wall time across attempts, good and bad
  lease      DIR/lease.json: one live run per workdir
  plot       `disttrain plot`: curves of one or more runs
"""
