"""Preference pairs (DPO): JSON lines in TRL's preference format, as rows of [2, T] per example.

  {"prompt": "...", "chosen": "...", "rejected": "..."}                       plain text
  {"prompt": [{"role": "user", ...}], "chosen": [{"role": "assistant", ...}],
   "rejected": [{"role": "assistant", ...}]}                                  conversational

A conversational pair is rendered with the model's chat template (data/chat.py) as the prompt
turns followed by the chosen (or rejected) turns; plain text is the prompt then the completion.
Row 0 of an example is the chosen sequence, row 1 the rejected one: tokens, next-token targets
and a loss mask on the completion's tokens (the template's assistant turns), padded to
data.seq_len with targets of -1. A sequence longer than a row keeps the prompt's end and the
completion's start (TRL's keep_end for prompts), so the completion is never dropped whole; both
rows of a pair keep the same prompt tokens (the fewer either needs), one context for both.
"""

import time

import numpy as np

from disttrain.data import chat, formats
from disttrain.errors import DataError

PIECES = list[tuple[str, bool]]


def _turns(value) -> bool:
  return isinstance(value, list) and all(
      isinstance(t, dict) and isinstance(t.get('content'), str) for t in value)


def pieces(record: dict, where: str, template, fields=('prompt', 'chosen', 'rejected')
           ) -> tuple[PIECES, PIECES]:
  """(chosen, rejected) as (text, trained) pieces of one line."""
  prompt_f, chosen_f, rejected_f = fields
  missing = [f for f in (chosen_f, rejected_f) if f not in record]
  if missing:
    raise DataError(f'{where}: a preference line needs {chosen_f!r} and {rejected_f!r}, this one '
                    f'has no {missing[0]!r} (fields: {sorted(record)}); add it or fix the file')
  prompt = record.get(prompt_f, [] if _turns(record[chosen_f]) else '')
  out = []
  for field in (chosen_f, rejected_f):
    completion = record[field]
    if isinstance(prompt, str) and isinstance(completion, str):
      out.append([(prompt, False), (completion, True)])
    elif _turns(prompt) and _turns(completion):
      if template is None:  # by position: a prompt turn equal to the answer is still context
        out.append([piece for i, t in enumerate(prompt + completion) for piece in (
            (f'<|{t.get("role", "user")}|>\n', False),
            (t['content'] + '\n', t.get('role') == 'assistant' and i >= len(prompt)))])
      else:  # the prompt's own assistant turns are context here, not trained
        prompt_chars = len(template.render(prompt, True, example=where)) if prompt else 0
        at, kept = 0, []
        for text, trained in template.pieces(prompt + completion, where):
          kept.append((text, trained and at >= prompt_chars))
          at += len(text)
        out.append(chat.Rendered(kept))
    else:
      raise DataError(f'{where}: {prompt_f!r} and {field!r} must both be text or both lists of '
                      '{"role", "content"} turns')
  return out[0], out[1]


def _prompt_kept(ids: list[int], mask: list[int], seq_len: int, where: str) -> tuple[int, int]:
  """(the completion's first id, the prompt tokens a row keeps: its end, at least half a row of
  it, and the completion's start)."""
  if not any(mask):
    raise DataError(f'{where}: the completion has no tokens to train; check the line')
  first = int(np.argmax(np.asarray(mask) > 0))  # the completion's first token
  window = seq_len + 1  # one more id than positions
  if len(ids) <= window:
    return first, first
  return first, max(window - (len(ids) - first), min(first, window // 2))


def _row(ids: list[int], mask: list[int], seq_len: int, start: int):
  """tokens, targets, loss_mask of length seq_len, from ids[start] on."""
  ids, mask = np.asarray(ids, np.int64), np.asarray(mask, np.int64)
  ids, mask = ids[start:start + seq_len + 1], mask[start:start + seq_len + 1]
  tokens = np.zeros(seq_len, np.int32)
  targets = np.full(seq_len, -1, np.int32)
  loss_mask = np.zeros(seq_len, np.int8)
  n = len(ids) - 1
  tokens[:n], targets[:n], loss_mask[:n] = ids[:-1], ids[1:], mask[1:]
  return tokens, targets, loss_mask


def read(paths: list[str], tokenizer, seq_len: int, template=None, verbose: bool = False) -> dict:
  """Every pair of the JSON-lines files as arrays [N, 2, seq_len] (tokens, targets, loss_mask)."""
  rows = {'tokens': [], 'targets': [], 'loss_mask': []}
  start, last, count = time.monotonic(), time.monotonic(), 0
  for where, record in formats.json_lines(
      paths, 'preference data is JSON lines (.jsonl) of prompt/chosen/rejected'):
    if not isinstance(record, dict):
      raise DataError(f'{where} is not a JSON object with prompt/chosen/rejected')
    encoded = [tokenizer.encode_pieces(p) for p in pieces(record, where, template)]
    # Both rows keep the same prompt tokens, so chosen and rejected answer the same context.
    kept = [_prompt_kept(ids, mask, seq_len, where) for ids, mask in encoded]
    keep = min(k for _, k in kept)
    pair = [_row(ids, mask, seq_len, first - keep)
            for (ids, mask), (first, _) in zip(encoded, kept)]
    for k, name in enumerate(rows):
      rows[name].append(np.stack([pair[0][k], pair[1][k]]))
    count += 1
    now = time.monotonic()
    if verbose and now - last >= 5:
      print(f'tokenizing preference pairs: {count:,} read, {count / (now - start):,.0f} '
            'pairs/s', flush=True)
      last = now
  if not count:
    raise DataError(f'the preference files {paths[:3]} hold no pairs; pass non-empty files')
  return {name: np.stack(values) for name, values in rows.items()}
