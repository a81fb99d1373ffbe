"""lm-evaluation-harness on a disttrain model: every task the harness knows, scored on the mesh.

  disttrain lm-eval --workdir=RUN | --hf_dir=DIR --tasks=arc_easy,hellaswag [--limit=N]
      [--include_path=DIR] [--batch_size=32] [--max_length=T] [--fake_devices=8] [--output=PATH]
  harness.evaluate(trained.load(...), ['arc_easy'], batch_size=32) -> lm_eval's results dict

`backend(...)` is a model backend of the `lm_eval` package (a TemplateLM subclass): its
requests are answered by the in-loop evaluator's batched scorer (scoring.Scorer) on the model's
mesh, tokenized as the harness's `hf` backend does by default: texts get what the tokenizer adds
itself (Llama's, Mistral's, Gemma's BOS; nothing for GPT-2's), and the prefix token (an empty
context, the first rolling window) is the BOS, else the end-of-text token. loglikelihood:
TemplateLM's (context, continuation) pairs (the context's trailing whitespace starts the
continuation); loglikelihood_rolling: disjoint windows of max_length tokens after the prefix
token; generate_until: greedy KV-cache decoding of max_gen_toks tokens (or an alias lm-eval
accepts: max_new_tokens, ...), the text cut at the first stop string (end of text included).
Sampling (do_sample=True, or a temperature > 0 without do_sample) is refused.
Tasks by name, before any model loads: evaluation/harness_tasks.py. `lm_eval` is not a
dependency of disttrain: pip install lm_eval.
"""

import time
from typing import Any

from disttrain.errors import ConfigError
from disttrain.evaluation import harness_tasks, scoring
from disttrain.operating.metrics import format_eta
from disttrain.parallel import mesh as mesh_lib

PROGRESS_SECONDS = 10.0


def backend(scorer: scoring.Scorer, tokenizer, vocab_size: int, max_gen_toks: int = 256,
            room: str = 'raise --max_length') -> Any:
  """A DisttrainLM answering with `scorer` (its batch, mesh and window length); set its `params`
  (and `mutable`: a LoRA run's frozen base) before each evaluation. `room`: the fix for a task
  that generates a whole window."""
  _, api_model = harness_tasks.package()

  class DisttrainLM(api_model.TemplateLM):
    """lm_eval's model interface answered by scoring.Scorer (module doc)."""

    def __init__(self):
      super().__init__()
      self.tokenizer_ = tokenizer
      eos = tokenizer.eos_within(vocab_size)
      if eos is None:
        raise ConfigError(f'the tokenizer {tokenizer.path or "(bytes)"!r} has no end-of-text '
                          f"token within the model's {vocab_size} ids, which lm-eval uses as the "
                          'empty context and a stop string; use a tokenizer that has one' + (
                              f', or train with model.vocab_size > {tokenizer.eos_id} (its id)'
                              if tokenizer.eos_id is not None else ''))
      self.eos, self.scorer = eos, scorer
      self.max_length, self.max_gen_toks = scorer.max_len, max_gen_toks
      self.params, self.mutable = None, {}
      self.beat = lambda: None  # the in-loop watchdog's heartbeat, at every batch and encoding

    def _progress(self, what: str, rows: int, quiet: bool):
      shown = None if quiet else _Progress(what, rows)
      def done(n: int) -> None:
        self.beat()
        if shown is not None:
          shown(n)
      return done

    @property
    def eot_token_id(self) -> int:
      return self.eos

    @property
    def prefix_token_id(self) -> int:
      bos = self.tokenizer_.bos_id
      return bos if bos is not None and bos < vocab_size else self.eos

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
      del kwargs
      if add_special_tokens is None:  # the tokenizer's default, but one BOS (TemplateLM's rule)
        prefix = self.tokenizer_.id_to_token(self.prefix_token_id)  # '<s>': decode drops it
        add_special_tokens = not (prefix and string.startswith(prefix))
      self.beat()
      return self.tokenizer_.encode(string, special=add_special_tokens)

    def tok_decode(self, tokens) -> str:
      return self.tokenizer_.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
      del kwargs
      pairs = [(context, continuation) for _, context, continuation in requests]
      return self.scorer.loglikelihoods(self.params, self.mutable, pairs, self._progress(
          'loglikelihood', len(pairs), disable_tqdm))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
      from lm_eval import utils  # pylint: disable=g-import-not-at-top
      windows, owners = [], []
      for i, (text,) in enumerate(req.args for req in requests):
        for window in utils.get_rolling_token_windows(
            token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
            max_seq_len=self.max_length, context_len=1):
          windows.append(utils.make_disjoint_window(window))
          owners.append(i)
      scored = self.scorer.loglikelihoods(self.params, self.mutable, windows, self._progress(
          'loglikelihood_rolling', len(windows), disable_tqdm))
      totals = [0.0] * len(requests)
      for owner, (ll, _) in zip(owners, scored):
        totals[owner] += ll
      return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
      groups: dict[tuple, list[int]] = {}  # (max_gen_toks, stop strings) -> request indices
      for i, req in enumerate(requests):
        new, until, sample = harness_tasks.generation(req.args[1], self.max_gen_toks)
        if sample:
          raise ConfigError(f'task {req.task_name!r} samples (do_sample / temperature > 0); '
                            'the disttrain backend generates greedily only')
        if new >= self.max_length:
          raise ConfigError(f'task {req.task_name!r} generates {new} tokens, which leaves no '
                            f'room for a prompt in {self.max_length}; {room}')
        groups.setdefault((new, tuple(until)), []).append(i)
      out = [''] * len(requests)
      for (new, until), indices in groups.items():
        prompts = [self.tok_encode(requests[i].args[0]) or [self.prefix_token_id]
                   for i in indices]
        texts = self.scorer.greedy(self.params, self.mutable, prompts, new, self._progress(
            'generate_until', len(prompts), disable_tqdm))
        for i, ids in zip(indices, texts):
          out[i] = cut(self.tok_decode(ids), until)
      return out

  return DisttrainLM()


def cut(text: str, until) -> str:
  """The text before the first stop string (lm-eval's postprocessing for `until`)."""
  for stop in until:
    if stop:
      text = text.split(stop)[0]
  return text


def evaluate(trained, tasks: list[str], *, batch_size: int = 32, limit: int | None = None,
             include_path: str | None = None, max_length: int | None = None,
             num_fewshot: int | None = None, log_samples: bool = False, manager=None) -> dict:
  """lm_eval.simple_evaluate of `tasks` with the disttrain backend over `trained`
  (hf.trained.Trained: model, parameters on its mesh, tokenizer, context)."""
  manager = manager or harness_tasks.task_manager(tasks, include_path)
  window = min(max_length or trained.context, trained.context)
  vocab = trained.model.cfg.vocab_size
  scorer = scoring.Scorer(trained.model, mesh_lib.batch_sharding(trained.mesh), batch_size,
                          window, trained.stop_ids())
  lm = backend(scorer, trained.tokenizer, vocab)
  lm.params = trained.params
  return run(lm, tasks, manager, limit=limit, num_fewshot=num_fewshot, log_samples=log_samples)


def run(lm, tasks: list[str], manager, limit: int | None = None, num_fewshot: int | None = None,
        log_samples: bool = False) -> dict:
  """lm_eval.simple_evaluate with a backend whose parameters are set."""
  lm_eval, _ = harness_tasks.package()
  return lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager,
                                 num_fewshot=num_fewshot, log_samples=log_samples,
                                 bootstrap_iters=0)


def records(results: dict) -> dict[str, dict]:
  """{task: {metric: value, 'num_examples': n}} of lm_eval's results, the in-loop records of
  data.eval_harness: 'acc,none' -> 'acc'; a filter other than none is kept, as gsm8k's two are
  ('exact_match,strict-match' -> 'exact_match_strict-match')."""
  out = {}
  for task, fields in results['results'].items():
    row = {}
    for name, v in fields.items():
      if ',' in name and '_stderr' not in name and isinstance(v, (int, float)):
        metric, kept = name.split(',', 1)
        row[metric if kept == 'none' else f'{metric}_{kept}'] = float(v)
    row['num_examples'] = int(results.get('n-samples', {}).get(task, {}).get(
        'effective', fields.get('sample_len', 0)))
    out[task] = row
  return out


def main(argv) -> None:
  import json  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from disttrain.hf import trained as trained_lib  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; pass --tasks=a,b')
  f = flags.FLAGS
  tasks = harness_tasks.names(f.tasks)
  for flag, low in (('batch_size', 1), ('max_length', 2), ('limit', 1), ('num_fewshot', 0)):
    if getattr(f, flag) is not None and getattr(f, flag) < low:
      raise ConfigError(f'--{flag}={getattr(f, flag)} must be >= {low}; pass one, or leave it '
                        'out for the default')
  mesh = trained_lib.parse_mesh(f.mesh)
  # Before the model loads: a task's typo fails at once.
  manager = harness_tasks.task_manager(tasks, f.include_path)
  if f.fake_devices:
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', f.fake_devices)
  lm = trained_lib.load(workdir=f.workdir, hf_dir=f.hf_dir, step=f.step, tokenizer=f.tokenizer,
                        mesh=mesh)
  start = time.perf_counter()
  results = evaluate(lm, tasks, batch_size=f.batch_size, limit=f.limit, manager=manager,
                     max_length=f.max_length, num_fewshot=f.num_fewshot)
  from lm_eval.utils import make_table  # pylint: disable=g-import-not-at-top
  print(make_table(results))
  print(f'{", ".join(tasks)} on {lm.source}, {lm.mesh.size} devices {dict(lm.mesh.shape)}, in '
        f'{time.perf_counter() - start:.1f}s', flush=True)
  if f.output:
    with open(f.output, 'w', encoding='utf-8') as out:
      json.dump({k: results[k] for k in ('results', 'versions', 'n-shot', 'configs')
                 if k in results}, out, indent=1, default=str)


class _Progress:
  """Rows scored -> rate and ETA every PROGRESS_SECONDS (the harness's tqdm bars are per call)."""

  def __init__(self, what: str, rows: int):
    self.what, self.rows, self.done = what, rows, 0
    self.start = self.last = time.monotonic()

  def __call__(self, rows: int) -> None:
    self.done += rows
    now = time.monotonic()
    if now - self.last >= PROGRESS_SECONDS or self.done == self.rows:
      self.last, rate = now, self.done / max(now - self.start, 1e-9)
      if self.done < self.rows or now - self.start >= PROGRESS_SECONDS:
        print(f'{self.what}: {self.done:,}/{self.rows:,} requests, {rate:,.1f}/s, ETA '
              f'{format_eta((self.rows - self.done) / rate if rate else 0)}', flush=True)


if __name__ == '__main__':
  from absl import flags, logging  # pylint: disable=g-import-not-at-top
  from disttrain import commandline  # pylint: disable=g-import-not-at-top
  from disttrain.errors import one_line_errors  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.ERROR)
  flags.DEFINE_string('workdir', '', 'A run directory with a checkpoint.')
  flags.DEFINE_string('hf_dir', '', 'Or a Hugging Face model directory.')
  flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
  flags.DEFINE_string('tokenizer', None, "Tokenizer file (default: the run's data.tokenizer or "
                      "the directory's own).")
  flags.DEFINE_string('tasks', '', 'lm-eval task names, comma-separated.')
  flags.DEFINE_string('include_path', None, 'A directory of your own YAML tasks.')
  flags.DEFINE_integer('limit', None, 'At most this many examples per task.')
  flags.DEFINE_integer('num_fewshot', None, "Few-shot examples (default: the task's).")
  flags.DEFINE_integer('batch_size', 32, 'Rows per scoring batch (split over the batch axes).')
  flags.DEFINE_integer('max_length', None, "Tokens per scoring window (default: the model's "
                       'context).')
  flags.DEFINE_string('mesh', '', "A mesh instead of the run's (axes not named are 1), e.g. "
                      'data=-1.')
  flags.DEFINE_integer('fake_devices', None, 'Run on N CPU devices.')
  flags.DEFINE_string('output', '', "Write lm-eval's results (metrics, versions, configs) as "
                      'JSON here.')
  commandline.run(one_line_errors(main))
