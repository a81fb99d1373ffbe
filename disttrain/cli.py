"""The `disttrain` command: one entry point, a subcommand for each thing users run.

  disttrain train --config=launch/configs/mnist_mlp.py --workdir=runs/digits --fake_devices=8
  disttrain <subcommand> --help     that subcommand's flags

`disttrain X ARGS` runs the subcommand's module as `python -m <module> ARGS` would (its own absl
flags, its --help, its exit statuses); `python launch/train.py`, `launch/supervise.py` and
`launch/local_cluster.py` are the same programs as `disttrain train`, `supervise` and `cluster`.
"""

import runpy
import sys

# subcommand -> (module run as __main__, extra arguments, what it does)
COMMANDS = {
    'train': ('disttrain.launch.train', [], 'train a config file (--config, --workdir, '
              '--config.<field>=...)'),
    'check': ('disttrain.launch.train', ['--check'], 'validate the flags and the config of a '
              'train command without running it'),
    'batch-size': ('disttrain.launch.train', ['--find_batch_size'], 'the largest micro-batch per '
                   'device whose compiled train step fits the memory (--memory_limit=BYTES)'),
    'supervise': ('disttrain.launch.supervise', [], 'rerun a job from its last checkpoint until '
                  'it finishes: disttrain supervise [flags] -- COMMAND'),
    'cluster': ('disttrain.launch.cluster', [], 'run train as P local processes x D CPU devices '
                '(jax.distributed): disttrain cluster [flags] -- TRAIN FLAGS'),
    'export': ('disttrain.hf.export', [], "write a run's checkpoint as a Hugging Face directory"),
    'generate': ('disttrain.hf.generate', [], 'sample from a run or a Hugging Face directory'),
    'lm-eval': ('disttrain.evaluation.harness', [], 'lm-evaluation-harness tasks on a run or a '
                'Hugging Face directory, scored on the mesh (pip install lm_eval)'),
    'compare': ('disttrain.hf.compare', [], "a checkpoint's or an import's logits against "
                "transformers': largest difference and KL, exit 1 above --max_kl"),
    'convert': ('disttrain.data.convert', [], 'write a data set as ArrayRecord shards, token '
                'files or JSON lines'),
    'tokenizer': ('disttrain.data.tokenizer', [], 'train a byte-level BPE tokenizer.json on text '
                  'files'),
    'goodput': ('disttrain.operating.goodput', [], "a run's wall time across attempts, good and "
                'bad'),
    'plot': ('disttrain.operating.plot', [], 'train and eval curves of runs as one PNG'),
}


def usage() -> str:
  width = max(map(len, COMMANDS))
  lines = [f'  {name:<{width}}  {about}' for name, (_, _, about) in COMMANDS.items()]
  return ('usage: disttrain <subcommand> [flags]   (disttrain <subcommand> --help: its flags)\n\n'
          + '\n'.join(lines))


def main(argv: list[str] | None = None) -> None:
  argv = list(sys.argv if argv is None else argv)
  if len(argv) < 2 or argv[1] in ('-h', '--help', 'help'):
    print(usage())
    sys.exit(0 if len(argv) >= 2 else 2)
  name = argv[1]
  if name not in COMMANDS:
    from disttrain.exitcodes import Exit  # pylint: disable=g-import-not-at-top
    print(f'error: disttrain has no subcommand {name!r}; use one of {", ".join(COMMANDS)} '
          '(disttrain --help)', file=sys.stderr, flush=True)
    sys.exit(Exit.BAD_INPUT)
  module, extra, _ = COMMANDS[name]
  sys.argv = [f'disttrain {name}', *argv[2:], *extra]
  runpy.run_module(module, run_name='__main__', alter_sys=True)


if __name__ == '__main__':
  main()
