"""Downstream tasks: data.eval_tasks' NAME=PATH pairs and the JSON lines files they name.

  data.eval_tasks='arc=data/arc.jsonl;gsm8k=data/gsm8k.jsonl'     (command line, config file)
  data.eval_tasks=(('arc', 'data/arc.jsonl'), ('gsm8k', 'data/gsm8k.jsonl'))   (config file)

A file is one kind, decided by the keys of its first line:
  multiple choice  {"context": str, "choices": [str, ...], "answer": int}  each choice is a
                   continuation appended to the context as written; `answer` is its index
  generation       {"prompt": str, "answer": str, "until": [str, ...] (optional)}  the model
                   continues the prompt greedily; the text is cut at the first stop string, as
                   lm-eval's `until` (its gsm8k: ["Question:", "</s>", "<|im_end|>"])
Every line is read and checked when the run is set up; bad input is one ConfigError (the pairs)
or DataError (the files) line naming the file, the line and the fix, and the launcher exits 2.
Task names become record splits (`arc/accuracy`), so they are plain words without '/'.
"""

import dataclasses
import json
import os
import re
from typing import Any

from disttrain.errors import ConfigError, DataError

MULTIPLE_CHOICE = 'multiple_choice'
GENERATION = 'generation'
FIELDS = {MULTIPLE_CHOICE: ('context', 'choices', 'answer'), GENERATION: ('prompt', 'answer')}
_NAME = re.compile(r'^[A-Za-z0-9_.-]+$')
_EXAMPLE = "'arc=data/arc.jsonl;gsm8k=data/gsm8k.jsonl'"


@dataclasses.dataclass(frozen=True)
class Question:
  """A multiple-choice example: the right continuation of `context` is choices[answer]."""
  context: str
  choices: tuple[str, ...]
  answer: int


@dataclasses.dataclass(frozen=True)
class Prompt:
  """A generation example: `prompt`, greedily continued and cut at the first of `until`,
  should give `answer`."""
  prompt: str
  answer: str
  until: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Task:
  """One task file: its name (the records' split), path, kind and examples in file order."""
  name: str
  path: str
  kind: str  # MULTIPLE_CHOICE or GENERATION
  examples: tuple  # Question or Prompt

  def __len__(self) -> int:
    return len(self.examples)


def pairs(spec: Any) -> list[tuple[str, str]]:
  """data.eval_tasks as checked (name, path) pairs: 'NAME=PATH;...' or ((name, path), ...).

  Raises:
    ConfigError: a pair that is not NAME=PATH, a name that is not a plain word, a name twice.
  """
  if isinstance(spec, str):
    found = []
    for item in (part.strip() for part in spec.split(';')):
      if not item:
        continue
      name, sep, path = item.partition('=')
      if not sep or not name.strip() or not path.strip():
        raise ConfigError(f'data.eval_tasks: {item!r} is not NAME=PATH; separate pairs with ";", '
                          f'e.g. {_EXAMPLE}')
      found.append((name.strip(), path.strip()))
  elif isinstance(spec, (tuple, list)):
    found = []
    for item in spec:
      if not (isinstance(item, (tuple, list)) and len(item) == 2
              and all(isinstance(x, str) and x.strip() for x in item)):
        raise ConfigError(f'data.eval_tasks: {item!r} is not a (name, path) pair of strings; '
                          "give ((name, path), ...), e.g. (('arc', 'data/arc.jsonl'),)")
      found.append((item[0].strip(), item[1].strip()))
  else:
    raise ConfigError(f'data.eval_tasks={spec!r} must be a string NAME=PATH;... or a tuple of '
                      f'(name, path) pairs, e.g. {_EXAMPLE}')
  seen = set()
  for name, _ in found:
    if not _NAME.match(name):
      raise ConfigError(f'data.eval_tasks: task name {name!r} is not a plain word (letters, '
                        'digits, _ . -): it names the records, as NAME/accuracy; rename it')
    if name in seen:
      raise ConfigError(f'data.eval_tasks names {name!r} twice; give each task its own name')
    seen.add(name)
  return found


def names(spec: Any) -> list[str]:
  """The task names data.eval_tasks gives (checked as `pairs` does)."""
  return [name for name, _ in pairs(spec)]


def load(spec: Any) -> list[Task]:
  """Every task data.eval_tasks names, read and checked."""
  return [read(name, path) for name, path in pairs(spec)]


def read(name: str, path: str) -> Task:
  """Task `name` from the JSON lines file `path` (blank lines skipped).

  Raises:
    DataError: a missing file, a line that is not a JSON object, a missing or mistyped field, an
      answer index out of range, or an empty file.
  """
  path = os.path.expanduser(path)  # as data.train_files: the shell leaves NAME=~/x alone
  if not os.path.isfile(path):
    raise DataError(f'data.eval_tasks: task {name!r}: {path} is not a file; pass NAME=PATH with '
                    'the path of a local JSON lines file')
  kind, examples = None, []
  try:
    with open(path, encoding='utf-8-sig') as file:  # a BOM, as the training readers allow it
      for number, line in enumerate(file, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except json.JSONDecodeError as e:
          raise DataError(f'{path}, line {number}: not valid JSON ({e.msg} at column {e.colno}); '
                          'write one JSON object per line') from None
        if not isinstance(row, dict):
          raise DataError(f'{path}, line {number}: a JSON {type(row).__name__}, not an object; '
                          'write one {...} object per line')
        kind = kind or _kind(row, path, number)
        examples.append(_example(row, kind, path, number))
  except UnicodeDecodeError as e:
    raise DataError(f'{path}: not UTF-8 text ({e.reason} at byte {e.start}); save the task file '
                    'as UTF-8') from None
  if not examples:
    raise DataError(f'data.eval_tasks: task {name!r}: {path} has no examples; write one JSON '
                    'object per line')
  return Task(name, path, kind, tuple(examples))


def _kind(row: dict, path: str, number: int) -> str:
  """The file's kind from its first line's keys."""
  if 'choices' in row or 'context' in row:
    return MULTIPLE_CHOICE
  if 'prompt' in row:
    return GENERATION
  raise DataError(f'{path}, line {number}: keys {sorted(row)} are neither a multiple-choice '
                  'example {"context", "choices", "answer"} nor a generation example {"prompt", '
                  '"answer"}; write one of them')


def _example(row: dict, kind: str, path: str, number: int) -> Question | Prompt:
  """One line as its kind's example, every field present and well typed."""
  missing = [field for field in FIELDS[kind] if field not in row]
  if missing:
    fields = ', '.join(f'"{f}"' for f in FIELDS[kind])
    raise DataError(f'{path}, line {number}: no "{missing[0]}"; every line of a {kind} file (as '
                    f'its first line is) needs {fields}')
  where = f'{path}, line {number}'
  if kind == GENERATION:
    until = row.get('until') or []  # null or "" as absent
    until = [until] if isinstance(until, str) else until
    if not isinstance(until, list):
      raise DataError(f'{where}: "until" is {until!r}; give a stop string or a list of them')
    return Prompt(_text(row['prompt'], 'prompt', where),
                  _text(row['answer'], 'answer', where, empty=True),
                  tuple(_text(u, 'a stop string', where) for u in until))
  context = _text(row['context'], 'context', where)
  choices = row['choices']
  if not isinstance(choices, list) or len(choices) < 2:
    raise DataError(f'{where}: "choices" is {choices!r}; give a list of at least 2 strings')
  choices = tuple(_text(c, f'choice {i}', where) for i, c in enumerate(choices))
  answer = row['answer']
  if isinstance(answer, bool) or not isinstance(answer, int):
    raise DataError(f'{where}: "answer" is {answer!r}; give the index of the right choice, an '
                    f'integer from 0 to {len(choices) - 1}')
  if not 0 <= answer < len(choices):
    raise DataError(f'{where}: "answer" {answer} is out of range for {len(choices)} choices; '
                    f'give the index of the right choice, 0 to {len(choices) - 1}')
  return Question(context, choices, answer)


def _text(value: Any, field: str, where: str, empty: bool = False) -> str:
  if not isinstance(value, str) or not (empty or value):
    raise DataError(f'{where}: {field} is {value!r}; give a {"" if empty else "non-empty "}string')
  try:
    value.encode('utf-8')
  except UnicodeEncodeError as e:  # '\ud83d': half an escaped emoji, which JSON lets through
    raise DataError(f'{where}: {field} has an unpaired surrogate {value[e.start]!r} at character '
                    f'{e.start}; write the whole character') from None
  return value
