"""Logits of disttrain against `transformers` on the same prompts: what to run after an import.

  disttrain compare --hf_dir=HF_DIR [--prompt=TEXT ...]              # our import of it vs theirs
  disttrain compare --workdir=RUN_DIR [--step=N] [--hf_dir=HF_DIR]   # the run's checkpoint vs
      an HF directory (default: a fresh export of that checkpoint); e.g. RUN_DIR/hf/<step>

Both models run in float32 (transformers with eager attention) on each prompt, tokenized with
the model's tokenizer. It prints the largest absolute logit difference and the KL divergence
KL(transformers || disttrain) per token (its mean and largest), and exits 1 when the largest KL
passes --max_kl (0.015, MaxText's forward_pass_logit_checker threshold) or, when set, the logit
difference passes --max_logit_diff; bad input exits 2.
"""

import json
import os
import sys
import tempfile

import numpy as np

from disttrain import commandline

_PROMPTS = ('The capital of France is', 'def fibonacci(n):\n    ',
            'In 1905, Albert Einstein published')


def _ours(lm, tokens: list[int]) -> np.ndarray:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from disttrain.models import moe  # pylint: disable=g-import-not-at-top
  # transformers routes every choice: a run's capacity would drop some and read as a mismatch.
  module = moe.dropless(lm.model.module)
  logits = module.apply({'params': lm.params}, jnp.asarray([tokens]), False)
  return np.asarray(logits, np.float64)[0, :, :lm.model.cfg.vocab_size]


def _theirs(hf_dir: str, prompts: list[list[int]]) -> list[np.ndarray]:
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    from disttrain.errors import ConfigError  # pylint: disable=g-import-not-at-top
    raise ConfigError(f'disttrain compare runs transformers as the reference ({e}); pip install '
                      "'disttrain[compare]'") from e
  model = transformers.AutoModelForCausalLM.from_pretrained(
      hf_dir, dtype=torch.float32, attn_implementation='eager')
  model.eval()
  with torch.no_grad():
    return [model(torch.tensor([p])).logits[0].double().numpy() for p in prompts]


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(*, hf_dir: str = '', workdir: str = '', step: int | None = None,
            prompts: list[str] | None = None) -> dict:
  """{'max_logit_diff', 'kl_mean', 'kl_max', 'tokens', 'ours', 'reference'} over the prompts."""
  import jax  # pylint: disable=g-import-not-at-top
  from disttrain.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from disttrain.hf import exported_config, saves, trained  # pylint: disable=g-import-not-at-top
  from disttrain.parallel import mesh  # pylint: disable=g-import-not-at-top
  if not (hf_dir or workdir):
    raise ConfigError('pass --hf_dir=HF_DIR, --workdir=RUN_DIR, or both')
  if hf_dir and workdir and not os.path.isfile(os.path.join(hf_dir, 'config.json')):
    # transformers would take it for a Hub id and go to the network, after our side loaded
    raise ConfigError(f'--hf_dir={hf_dir!r} is not a Hugging Face model directory (no '
                      'config.json); pass the folder an export or a save wrote')
  one = {'devices': jax.devices()[:1], 'mesh': {axis: 1 for axis in mesh.AXES},
         'compute_dtype': 'float32'}
  lm = (trained.load(workdir=workdir, step=step, **one) if workdir
        else trained.load(hf_dir=hf_dir, **one))
  texts = list(prompts or _PROMPTS)
  tokens = [lm.tokenizer.encode(t)[:lm.context] for t in texts]
  if any(not t for t in tokens):
    raise ConfigError('a prompt has no tokens; pass non-empty --prompt texts')
  with tempfile.TemporaryDirectory(prefix='disttrain-compare-') as scratch:
    reference = hf_dir
    if not reference:  # the checkpoint as transformers would get it: exported now
      exported_config.check_exportable(lm.model, workdir)
      saves.write(scratch, lm.model.family, lm.cfg.model, lm.model.cfg, lm.params, lm.tokenizer,
                  lm.context)
      reference = scratch
    theirs = _theirs(reference, tokens)
  diff, kls = 0.0, []
  for ids, reference_logits in zip(tokens, theirs):
    ours = _ours(lm, ids)
    if reference_logits.shape != ours.shape:
      raise ConfigError(f'{reference} gives logits of shape {reference_logits.shape}, disttrain '
                        f'{ours.shape}: not the same model; compare a checkpoint with its own '
                        'export')
    diff = max(diff, float(np.abs(ours - reference_logits).max()))
    p_log = _log_softmax(reference_logits)
    kls += list((np.exp(p_log) * (p_log - _log_softmax(ours))).sum(-1))
  return {'max_logit_diff': diff, 'kl_mean': float(np.mean(kls)), 'kl_max': float(np.max(kls)),
          'tokens': int(sum(map(len, tokens))), 'ours': lm.source,
          'reference': hf_dir or f'an export of {lm.source}'}


def main(argv) -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  del argv
  f = flags.FLAGS
  commandline.output_file('json', f.json)
  out = compare(hf_dir=f.hf_dir, workdir=f.workdir, step=f.step, prompts=f.prompt)
  failed = out['kl_max'] > f.max_kl or (f.max_logit_diff and
                                        out['max_logit_diff'] > f.max_logit_diff)
  print(f'{"FAIL" if failed else "ok"}: disttrain ({out["ours"]}) against transformers '
        f'({out["reference"]}) on {out["tokens"]} tokens: largest logit difference '
        f'{out["max_logit_diff"]:.3g}, KL mean {out["kl_mean"]:.3g}, largest {out["kl_max"]:.3g} '
        f'(--max_kl={f.max_kl:g}' + (f', --max_logit_diff={f.max_logit_diff:g})'
                                     if f.max_logit_diff else ')'), flush=True)
  if f.json:
    with open(f.json, 'w', encoding='utf-8') as file:
      json.dump({**out, 'failed': bool(failed)}, file, indent=1)
  sys.exit(1 if failed else 0)


if __name__ == '__main__':
  from absl import flags, logging  # pylint: disable=g-import-not-at-top
  from disttrain.errors import one_line_errors  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.ERROR)  # orbax's info and read-only notes
  flags.DEFINE_string('hf_dir', '', 'A Hugging Face model directory.')
  flags.DEFINE_string('workdir', '', 'A run directory with a checkpoint.')
  flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
  flags.DEFINE_multi_string('prompt', None, 'Prompt text; repeat for more (default: three '
                            'built-in prompts).')
  flags.DEFINE_float('max_kl', 0.015, 'Fail (exit 1) when a token\'s KL divergence passes this.',
                     lower_bound=0)
  flags.DEFINE_float('max_logit_diff', 0.0, 'Fail when the largest logit difference passes '
                     'this; 0 = not checked.', lower_bound=0)
  flags.DEFINE_string('json', '', 'Also write the figures as JSON to this file.')
  commandline.run(one_line_errors(main))
