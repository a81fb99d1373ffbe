"""What users run: the absl launcher, the restart supervisor and the local multi-process job.

  train       flags -> locked ConfigDict -> Config -> disttrain.train (`disttrain train`,
              `python launch/train.py`); --check validates without running
  config_args  --config and its --config.<field> overrides: the file's path; a bad flag,
              override or file as one line
  supervise   restarts a failed job from its last committed checkpoint, by exit status
  cluster     P local processes x D fake CPU devices as one jax.distributed job
The `disttrain` command (disttrain/cli.py) names train, supervise, cluster and the other tools
as subcommands.
"""
