"""A run's downstream evaluations: data.eval_tasks read and tokenized once, scored at each eval.

  Downstream.build(cfg, model, batch_sharding, eval_splits, extract) -> Downstream | None
  downstream(state, say, beat) -> {task name: {'accuracy', 'accuracy_norm', 'num_examples'}
                                              or {'exact_match', 'num_examples'}}

The loop's Evaluator (training/actions.py) calls it with the parameters the loss eval uses (the
moving average under ema_eval) and emits one record per task, split = the task's name.

Tokenization (data.tokenizer; '' = bytes) is lm-eval's Hugging Face backend's: the context's
trailing whitespace moves to the front of the continuation; context + continuation are encoded
whole and the continuation is what follows the first len(encode(context)) tokens (a token that
straddles the boundary belongs to the continuation), after the context encoded alone. Texts are
encoded with what the tokenizer adds at a text's start (a BOS), as training documents were.
Scoring windows hold at most cfg.row_tokens tokens (data.seq_len; fewer for a model with fewer
learned positions): longer requests lose tokens from the left, as lm-eval's do.
"""

import time
from typing import Any, Callable

from disttrain.config import Config
from disttrain.data import tokenizer as tokenizer_lib
from disttrain.errors import ConfigError, DataError
from disttrain.evaluation import harness, harness_tasks, metrics, scoring, tasks as tasks_lib
from disttrain.evaluation.tasks import GENERATION, Task
from disttrain.operating.metrics import format_eta

PROGRESS_SECONDS = 5.0  # an evaluation running longer than this prints its rate and ETA


class Downstream:
  """The tasks of data.eval_tasks, tokenized, and the scorer that evaluates them (module doc)."""

  def __init__(self, cfg: Config, model, batch_sharding, tasks: list[Task],
               extract: Callable[[str], str] | None = None):
    lm, _ = scoring.language_model(model)
    self.tokenizer = tokenizer_lib.load(cfg.data.tokenizer)
    self.vocab = lm.cfg.vocab_size
    self.max_len = _row_tokens(cfg, lm)
    self.max_new = cfg.data.eval_max_new_tokens
    self.scorer = scoring.Scorer(model, batch_sharding, cfg.eval_batch, self.max_len,
                                 self.tokenizer.stop_ids(self.vocab))
    self.tasks, self.extract = tasks, extract or metrics.gsm8k_answer
    self.inputs = {task.name: self._encode(task) for task in tasks}
    self.record_names = set(self.inputs)  # splits of its records; build adds the harness's
    self.harness_tasks = harness_names(cfg)
    self.harness_limit = cfg.data.eval_harness_limit or None
    if self.harness_tasks:  # lm-evaluation-harness's tasks, answered by the same scorer
      self.manager = harness_tasks.task_manager(self.harness_tasks,
                                                cfg.data.eval_harness_include or None,
                                                '--config.data.eval_harness_include')
      room = ('generate fewer tokens (the task\'s max_gen_toks, else data.eval_max_new_tokens) '
              'or raise data.seq_len')
      for task, new in harness_tasks.generation_lengths(self.manager, self.harness_tasks,
                                                        self.max_new).items():
        if new >= self.max_len:  # found before the first step, not at the first eval
          raise ConfigError(f'data.eval_harness task {task!r} generates {new} tokens, which '
                            f'leaves no room for a prompt in the {self.max_len} tokens a row '
                            f'holds (data.seq_len); {room}')
      self.harness = harness.backend(self.scorer, self.tokenizer, self.vocab, self.max_new,
                                     room)

  @classmethod
  def build(cls, cfg: Config, model, batch_sharding, eval_splits=(),
            extract: Any = None) -> 'Downstream | None':
    """The run's downstream evaluations, or None without data.eval_tasks.

    Raises:
      ConfigError: eval_tasks for a model that is not a language model, a task named as an eval
        split, an extraction that is not callable, no room to generate in the model's context.
      DataError: a task file that is missing or malformed (tasks.read).
    """
    if not cfg.data.eval_tasks and not cfg.data.eval_harness:
      return None
    names = tasks_lib.names(cfg.data.eval_tasks) if cfg.data.eval_tasks else []
    clash = sorted(set(names + harness_names(cfg)) & {'train', *eval_splits})
    if clash:
      raise ConfigError(f'data.eval_tasks or data.eval_harness names {clash[0]!r}, which is '
                        'also an eval split of the run (records are named split/metric); rename '
                        'the task')
    both = sorted(set(names) & set(harness_names(cfg)))
    if both:
      raise ConfigError(f'{both[0]!r} is both a data.eval_tasks task and a data.eval_harness '
                        'task (records are named task/metric); rename one')
    lm, _ = scoring.language_model(model)
    if lm is None:
      field = 'data.eval_tasks' if cfg.data.eval_tasks else 'data.eval_harness'
      raise ConfigError(f'{field} scores a language model, and model.name='
                        f'{cfg.model.name!r} ({type(model).__name__}) is not one; use a gpt, '
                        f'llama, qwen, mistral, mixtral or gemma model, or drop {field}')
    if extract is not None and not callable(extract):
      raise ConfigError(f'get_eval_extract() returned {extract!r}, which is not callable; return '
                        'a function text -> answer string')
    tasks = tasks_lib.load(cfg.data.eval_tasks) if cfg.data.eval_tasks else []
    row = _row_tokens(cfg, lm)
    if row <= cfg.data.eval_max_new_tokens and any(t.kind == GENERATION for t in tasks):
      raise ConfigError(f'data.eval_max_new_tokens={cfg.data.eval_max_new_tokens} leaves no '
                        f'room for a prompt in the {row} tokens a row holds (data.seq_len); '
                        'generate fewer tokens or raise data.seq_len')
    made = cls(cfg, model, batch_sharding, tasks, extract)
    if made.harness_tasks:  # a group's or tag's tasks write records (arc_easy under ai2_arc)
      reached = harness_tasks.record_names(made.manager, made.harness_tasks)
      clash = sorted(reached & {*names, 'train', *eval_splits})
      if clash:
        raise ConfigError(f'data.eval_harness writes records named {clash[0]!r} (a task of one '
                          'of its groups or tags), as a data.eval_tasks task or an eval split of '
                          'the run does; rename the task or the split')
      made.record_names |= reached
    return made

  def _encode(self, task: Task) -> list:
    """Generation: each prompt's ids. Multiple choice: (context, continuation) ids per choice."""
    if task.kind == GENERATION:
      ids = self.tokenizer.encode_batch([p.prompt for p in task.examples])
      for number, row in enumerate(ids, 1):
        self._check_ids(task, number, row)
      return ids
    pairs = [_moved_whitespace(q.context, c) for q in task.examples for c in q.choices]
    contexts = self.tokenizer.encode_batch([context for context, _ in pairs])
    wholes = self.tokenizer.encode_batch([context + choice for context, choice in pairs])
    flat = iter([(c, w[len(c):]) for c, w in zip(contexts, wholes)])
    grouped = [[next(flat) for _ in q.choices] for q in task.examples]
    for number, question in enumerate(grouped, 1):
      for context, continuation in question:
        where = f'{task.path}: example {number} of task {task.name!r}'
        self._check_ids(task, number, context + continuation)
        if not context:
          raise DataError(f'{where}: the context has no tokens once its trailing whitespace '
                          'moves to the choices; give it some text')
        if len(continuation) > self.max_len:
          raise DataError(f'{where}: a choice of {len(continuation)} tokens is longer than the '
                          f'{self.max_len} tokens a row holds; shorten it or raise data.seq_len')
    return grouped

  def _check_ids(self, task: Task, number: int, row: list[int]) -> None:
    """Example `number` has tokens, all of them ids the model has."""
    where = f'{task.path}: example {number} of task {task.name!r}'
    if not row:
      raise DataError(f'{where} has no tokens; give it some text')
    if max(row) >= self.vocab:
      raise DataError(f'{where} has token id {max(row)}, beyond the model\'s {self.vocab} ids; '
                      "tokenize with the model's own tokenizer (data.tokenizer)")

  def __call__(self, state, say: Callable[[str], None] = print,
               beat: Callable[[], None] = lambda: None) -> dict[str, dict]:
    """Each task's record fields, from state.params (and state.mutable: LoRA's frozen base)."""
    results = {}
    for task in self.tasks:
      inputs = self.inputs[task.name]
      if task.kind == GENERATION:
        progress = _Progress(task, len(inputs), say, beat)
        new = self.scorer.greedy(state.params, state.mutable, inputs, self.max_new, progress)
        texts = [harness.cut(self.tokenizer.decode(ids), example.until)
                 for ids, example in zip(new, task.examples)]
        results[task.name] = metrics.generation(texts, task.examples, self.extract)
      else:
        flat = [request for question in inputs for request in question]
        progress = _Progress(task, len(flat), say, beat)
        scored = iter(self.scorer.loglikelihoods(state.params, state.mutable, flat, progress))
        lls = [[next(scored)[0] for _ in question] for question in inputs]
        results[task.name] = metrics.multiple_choice(lls, task.examples)
      progress.finish()
    if self.harness_tasks:
      self.harness.params, self.harness.mutable = state.params, state.mutable
      self.harness.beat = beat
      beat()
      results.update(harness.records(harness.run(self.harness, self.harness_tasks, self.manager,
                                                 limit=self.harness_limit)))
      beat()
    return results


def harness_names(cfg: Config) -> list[str]:
  """data.eval_harness's task names."""
  return harness_tasks.names(cfg.data.eval_harness)


def _row_tokens(cfg: Config, lm) -> int:
  """The longest scoring window: the training rows' length, or the model's positions if fewer."""
  return min(cfg.row_tokens, lm.cfg.learned_positions or cfg.row_tokens)


def _moved_whitespace(context: str, continuation: str) -> tuple[str, str]:
  """lm-eval's _encode_pair: the context's trailing whitespace starts the continuation."""
  spaces = len(context) - len(context.rstrip())
  if spaces:
    return context[:-spaces], context[-spaces:] + continuation
  return context, continuation


class _Progress:
  """Rows done -> examples/s and ETA every PROGRESS_SECONDS of a task's evaluation; the watchdog's
  heartbeat after every batch."""

  def __init__(self, task: Task, rows: int, say: Callable[[str], None], beat: Callable[[], None]):
    self.task, self.rows, self.say, self.beat = task, max(rows, 1), say, beat
    self.done, self.start = 0, time.monotonic()
    self.last = self.start

  def __call__(self, rows: int) -> None:
    self.done += rows
    self.beat()
    now = time.monotonic()
    if now - self.last >= PROGRESS_SECONDS:
      self.last = now
      self._say(now)

  def _say(self, now: float) -> None:
    examples = len(self.task) * self.done / self.rows
    rate = examples / max(now - self.start, 1e-9)
    left = (len(self.task) - examples) / rate if rate else float('inf')
    self.say(f'{self.task.name}: {examples:,.0f}/{len(self.task):,} examples, {rate:,.1f} '
             f'examples/s, ETA {format_eta(left)}')

  def finish(self) -> None:
    now = time.monotonic()
    if now - self.start >= PROGRESS_SECONDS:  # a long evaluation says how fast it finished
      self._say(now)
