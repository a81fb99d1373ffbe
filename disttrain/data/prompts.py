"""Prompts for reinforcement learning (GRPO): JSON lines with a `prompt` and the fields rewards read.

  {"prompt": "12+7=", "answer": "19"}                                   plain text
  {"prompt": [{"role": "user", "content": "12+7?"}], "answer": "19"}     chat turns

A plain prompt is encoded as it is; chat turns are rendered by the model's chat template with its
generation prompt (data/chat.py; without a template, disttrain's plain `<|role|>` lines and
`<|assistant|>`). Each line is a row of data.seq_len prompt tokens, left-padded as generate.py
pads (`prompt_mask` 0 on the padding), and its line number `index`; a longer prompt keeps its end
(TRL's left truncation) and is counted. The lines themselves stay on the host (`PromptSet`): the
rollout hands the reward functions each completion's prompt and the line's other fields.
"""

import dataclasses
import functools
import time

import numpy as np

from disttrain.data import chat, formats, tokenizer as tokenizer_lib
from disttrain.errors import DataError


@dataclasses.dataclass
class PromptSet:
  """Every prompt line of some files: the rows, and the lines as read (for the rewards)."""
  arrays: dict  # prompt [N, P] int32, prompt_mask [N, P] int8, index [N] int32
  lines: list[dict]  # the JSON objects, in index order
  chat: bool  # prompts are turns: completions go to the rewards as assistant turns (TRL)
  truncated: int  # prompts longer than a row that kept their end

  def reward_inputs(self, index: np.ndarray) -> tuple[list, dict]:
    """(prompts, {field: values}) of the rows `index`: what TRL hands its reward functions."""
    lines = [self.lines[int(i)] for i in index]
    names = sorted({k for line in lines for k in line if k != 'prompt'})
    return [line['prompt'] for line in lines], {k: [line.get(k) for line in lines] for k in names}


def _turns(value) -> bool:
  return isinstance(value, list) and bool(value) and all(
      isinstance(t, dict) and isinstance(t.get('content'), str) for t in value)


def _ids(prompt, tokenizer, template, where: str) -> list[int]:
  if isinstance(prompt, str):
    return tokenizer.encode(prompt)
  if template is None:
    text = ''.join(f'<|{t.get("role", "user")}|>\n{t["content"]}\n' for t in prompt)
    return tokenizer.encode(text + '<|assistant|>\n')
  return tokenizer.encode_whole([(template.render(prompt, True, example=where), False)])[0]


@functools.lru_cache(maxsize=4)  # the source and the rollout ask for the same files
def load(patterns: str, field: str, tokenizer_path: str, seq_len: int, chat_template: str,
         verbose: bool = False) -> PromptSet:
  """The prompts of data.train_files-style globs, tokenized once per process."""
  tokenizer = tokenizer_lib.load(tokenizer_path)
  return read(formats.resolve_files(patterns, field), tokenizer, seq_len,
              chat.load(tokenizer.file, chat_template), verbose)


def read(paths: list[str], tokenizer, seq_len: int, template=None,
         verbose: bool = False) -> PromptSet:
  """Every prompt line of the JSON-lines files, as rows of seq_len tokens."""
  lines, rows, masks, truncated = [], [], [], 0
  chat = None
  start, last = time.monotonic(), time.monotonic()
  for where, record in formats.json_lines(paths,
                                         'prompts are JSON lines (.jsonl) with a "prompt" field'):
    prompt = record.get('prompt') if isinstance(record, dict) else None
    if not (isinstance(prompt, str) and prompt) and not _turns(prompt):
      raise DataError(f'{where}: a prompt line needs "prompt": text or a list of '
                      '{"role", "content"} turns (fields: '
                      f'{sorted(record) if isinstance(record, dict) else type(record).__name__}'
                      '); add it or fix the file')
    if chat is not None and chat != _turns(prompt):
      raise DataError(f'{where}: its prompt is {"turns" if _turns(prompt) else "text"}, the '
                      'lines before had the other kind; use one kind per run')
    chat = _turns(prompt)
    ids = _ids(prompt, tokenizer, template, where)
    if len(ids) > seq_len:
      ids, truncated = ids[-seq_len:], truncated + 1
    row, mask = np.zeros(seq_len, np.int32), np.zeros(seq_len, np.int8)
    if ids:
      row[-len(ids):], mask[-len(ids):] = ids, 1
    rows.append(row)
    masks.append(mask)
    lines.append(record)
    now = time.monotonic()
    if verbose and now - last >= 5:
      print(f'tokenizing prompts: {len(lines):,} read, '
            f'{len(lines) / (now - start):,.0f} prompts/s', flush=True)
      last = now
  if not lines:
    raise DataError(f'the prompt files {list(paths)[:3]} hold no prompts; pass non-empty files')
  arrays = {'prompt': np.stack(rows), 'prompt_mask': np.stack(masks),
            'index': np.arange(len(lines), dtype=np.int32)}
  if verbose:
    print(f'prompts: {len(lines):,} lines of {seq_len} tokens'
          + (f'; {truncated:,} longer kept their last {seq_len} (raise data.seq_len to keep them '
             'whole)' if truncated else ''), flush=True)
  return PromptSet(arrays, lines, bool(chat), truncated)
