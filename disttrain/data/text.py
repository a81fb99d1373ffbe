"""Raw text on disk as random-access documents, and supervised fine-tuning examples.

  Documents(paths, text_field)   .txt (a file is a document), .jsonl (a line is a document: its
                                 `text_field`), .parquet (a row: column `text_field`)
  Conversations(paths, fields)   JSONL of {"prompt", "completion"} pairs or {"messages": [{"role",
                                 "content"}, ...]} chat turns -> [(text, trained?), ...] pieces

Files are indexed once (line offsets, row groups) and read per document, so a corpus is never
loaded whole; objects pickle as their paths and indexes, for worker processes. A line that is
not JSON or lacks the field is a DataError naming the file and line. Chat turns are rendered
with the tokenizer's chat template (disttrain/data/chat.py) when it has one, else with a plain
one ('<|role|>\\n' + content + '\\n'): the assistant's content and its end are trained, every
other piece is prompt.
"""

import json
import os
from typing import Any

import numpy as np

from disttrain.data.formats import json_line, resolve_files
from disttrain.errors import DataError, first_line

SUFFIXES = ('.txt', '.jsonl', '.json', '.parquet')
FIELD_SETTINGS = 'data.text_field, data.sft.*'  # a command with its own flag names that instead


def resolve(patterns: str, field: str) -> list[str]:
  """Sorted text files of comma-separated globs, each of a suffix this module reads."""
  paths = resolve_files(patterns, field)
  bad = [p for p in paths if not p.endswith(SUFFIXES)]
  if bad:
    raise DataError(f'{field}: {bad[0]} is not one of {SUFFIXES}; pass text (.txt), JSON lines '
                    '(.jsonl) or Parquet files')
  return paths


_SPACE = np.frombuffer(b' \t\r\n\x0b\x0c', np.uint8)


class _Lines:
  """Byte offsets of a JSONL file's non-empty lines (a newline scan over the mapped file)."""

  _CHUNK = 64 * 2**20  # bytes scanned at once: memory stays flat whatever the file's size

  def __init__(self, path: str):
    self.path = path
    size = os.path.getsize(path)
    data = np.memmap(path, np.uint8, mode='r') if size else np.zeros(0, np.uint8)
    newlines = [at + np.flatnonzero(data[at:at + self._CHUNK] == ord('\n'))
                for at in range(0, size, self._CHUNK)]
    ends = np.concatenate(newlines + [np.array([size])]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1])
    keep = ends > starts  # blank lines and the final newline are not documents
    if keep.any():  # nor lines of whitespace alone ('\r' of a CRLF file): those starting with it
      for i in np.flatnonzero(keep & np.isin(data[np.minimum(starts, size - 1)], _SPACE)):
        keep[i] = bool(bytes(data[starts[i]:ends[i]]).strip())
    del data
    self.starts, self.ends = starts[keep], ends[keep]
    self.line_numbers = np.flatnonzero(keep) + 1

  def __len__(self) -> int:
    return len(self.starts)

  def record(self, i: int, field_names: tuple[str, ...]) -> dict:
    with open(self.path, 'rb') as f:
      f.seek(int(self.starts[i]))
      raw = f.read(int(self.ends[i] - self.starts[i]))
    where = f'{self.path} line {int(self.line_numbers[i])}'
    record = json_line(raw, where)
    if not isinstance(record, dict) or not any(k in record for k in field_names):
      found = sorted(record) if isinstance(record, dict) else type(record).__name__
      raise DataError(f'{where} has no field {" or ".join(map(repr, field_names))} (it has '
                      f'{found}); set the field name ({FIELD_SETTINGS}) or fix the line')
    return record


def _parquet(path: str):
  """pyarrow's ParquetFile, or one line naming a file that is not Parquet."""
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise DataError(f"{path}: Parquet needs pyarrow ({e}); pip install '.[text]'") from e
  try:
    return pq.ParquetFile(path)
  except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid and ArrowIOError are these
    raise DataError(f'{path} is not a readable Parquet file ({first_line(e, 200)}); fix or '
                    'remove it') from None


class _Parquet:
  """Rows of a Parquet file's text column, read one row group at a time."""

  def __init__(self, path: str, column: str):
    meta = _parquet(path).metadata
    names = meta.schema.names
    if column not in names:
      raise DataError(f'{path} has no column {column!r} (it has {names}); set data.text_field')
    self.path, self.column = path, column
    self.ends = np.cumsum([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    self._group = (-1, None)

  def __len__(self) -> int:
    return int(self.ends[-1]) if len(self.ends) else 0

  def __getstate__(self) -> dict:
    return {**self.__dict__, '_group': (-1, None)}

  def text(self, i: int) -> str:
    group = int(np.searchsorted(self.ends, i, side='right'))
    if self._group[0] != group:
      try:
        table = _parquet(self.path).read_row_group(group, columns=[self.column])
      except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid and ArrowIOError are these
        raise DataError(f'{self.path} row group {group} cannot be read ({first_line(e, 200)}); '
                        'fix or remove the file') from None
      self._group = (group, table.column(0).to_pylist())
    value = self._group[1][i - (int(self.ends[group - 1]) if group else 0)]
    if isinstance(value, str):
      return value
    raise _not_text(value, f'{self.path} row {i}: column {self.column!r}',
                    f'drop those rows (pyarrow: table.filter(table[{self.column!r}].is_valid()))')


class _TextFile:
  """A .txt file: one document."""

  def __init__(self, path: str):
    self.path = path

  def __len__(self) -> int:
    return 1

  def text(self, i: int) -> str:
    del i
    with open(self.path, 'rb') as f:
      raw = f.read()
    try:  # a BOM (Windows editors write one) is no text; a bad byte is no character to train on
      return raw.decode('utf-8-sig')
    except UnicodeDecodeError as e:
      raise DataError(f'{self.path} is not UTF-8 text: byte {e.start} is {raw[e.start]:#04x} '
                      f'({e.reason}); convert the file, e.g. iconv -f latin1 -t utf-8') from None


class _Files:
  """Concatenated per-file readers: document i -> (reader, index within it)."""

  def __init__(self, readers: list):
    self.readers = readers
    self.ends = np.cumsum([len(r) for r in readers])

  def __len__(self) -> int:
    return int(self.ends[-1]) if len(self.ends) else 0

  def locate(self, i: int) -> tuple[Any, int]:
    if not 0 <= i < len(self):
      raise IndexError(f'document {i} out of range 0..{len(self) - 1}')
    f = int(np.searchsorted(self.ends, i, side='right'))
    return self.readers[f], i - (int(self.ends[f - 1]) if f else 0)


class Documents:
  """Document i of the files as a string (see the module docstring for the formats)."""

  def __init__(self, paths: list[str], text_field: str = 'text'):
    self.text_field = text_field
    self._files = _Files([_Parquet(p, text_field) if p.endswith('.parquet') else
                          _TextFile(p) if p.endswith('.txt') else _Lines(p) for p in paths])
    if not len(self):
      raise DataError(f'the text files {paths[:3]} hold no documents; pass non-empty files')

  def __len__(self) -> int:
    return len(self._files)

  def __getitem__(self, i: int) -> str:
    reader, j = self._files.locate(i)
    if not isinstance(reader, _Lines):
      return reader.text(j)
    value = reader.record(j, (self.text_field,))[self.text_field]
    if isinstance(value, str):
      return value
    key = json.dumps(self.text_field)  # jq's .["a-b"]: any key, not only identifiers
    raise _not_text(value, f'{reader.path} line {int(reader.line_numbers[j])}: field '
                    f'{self.text_field!r}', f"drop those lines (jq -c 'select(.[{key}] != null)')")


def _not_text(value, where: str, drop: str) -> DataError:
  """One line naming where a document's text is null or not text, and the fix (built only on
  failure: every document of a corpus passes through its reader)."""
  if value is None:  # exported datasets hold nulls for missing texts
    return DataError(f'{where} is null (a missing text); {drop}, or fill them')
  return DataError(f'{where} is {type(value).__name__}, not text; pick a text field or column '
                   '(data.text_field)')


class Conversations:
  """Example i of SFT JSONL files as pieces [(text, trained), ...] in order."""

  def __init__(self, paths: list[str], prompt_field: str = 'prompt',
               completion_field: str = 'completion', messages_field: str = 'messages',
               template=None):
    bad = [p for p in paths if not p.endswith(('.jsonl', '.json'))]
    if bad:
      raise DataError(f'{bad[0]}: supervised fine-tuning reads JSON lines (.jsonl) of '
                      f'{prompt_field}/{completion_field} pairs or {messages_field} turns')
    self.fields = (prompt_field, completion_field, messages_field)
    self.template = template  # a chat.ChatTemplate: `messages` rendered by it (chat.Rendered)
    self._files = _Files([_Lines(p) for p in paths])
    if not len(self):
      raise DataError(f'the SFT files {paths[:3]} hold no examples; pass non-empty files')

  def __len__(self) -> int:
    return len(self._files)

  def __getitem__(self, i: int) -> list[tuple[str, bool]]:
    reader, j = self._files.locate(i)
    prompt, completion, messages = self.fields
    record = reader.record(j, (messages, completion))
    where = f'{reader.path} line {int(reader.line_numbers[j])}'
    if messages in record:
      turns = record[messages]
      if not (isinstance(turns, list) and turns and all(
          isinstance(t, dict) and isinstance(t.get('content'), str) for t in turns)):
        raise DataError(f'{where}: {messages!r} must be a list of {{"role", "content"}} turns')
      if not any(t.get('role') == 'assistant' for t in turns):  # it trained the EOS alone
        raise DataError(f'{where}: {messages!r} has no assistant turn, so nothing to train on '
                        f'(roles {sorted({str(t.get("role")) for t in turns})}); add the reply '
                        "with role 'assistant', or drop the line")
      if self.template is not None:
        return self.template.pieces(turns, where)
      pieces = []
      for turn in turns:
        pieces.append((f'<|{turn.get("role", "user")}|>\n', False))
        pieces.append((turn['content'] + '\n', turn.get('role') == 'assistant'))
      return pieces
    if not isinstance(record.get(prompt, ''), str) or not isinstance(record[completion], str):
      raise DataError(f'{where}: {prompt!r} and {completion!r} must be text')
    return [(record.get(prompt, ''), False), (record[completion], True)]
