r"""Tokenizers for raw text: a Hugging Face tokenizer.json, a SentencePiece .model, or bytes.

  load('')                      bytes: ids 0..255, end of sequence 256 (vocabulary 257)
  load('DIR/tokenizer.json')    the `tokenizers` library (a directory holding one works too)
  load('DIR/tokenizer.model')   SentencePiece

`encode` adds what the tokenizer itself adds (a tokenizer.json's post-processor, SentencePiece's
BOS); documents are then ended with `eos_id`. The end-of-sequence token comes from a
tokenizer_config.json beside the file, else the first of the usual names in the vocabulary.
Generation stops at it and at every `eos_token_id` of a generation_config.json beside the file
(an instruct model's end of turn: Gemma's `<end_of_turn>`, Llama 3's `<|eot_id|>`).
Objects pickle as their path, so worker processes load their own copy.

  disttrain tokenizer --input='data/docs/train.jsonl' --vocab_size=4096 \
      --out=data/docs/tokenizer.json    # trains a byte-level BPE tokenizer (tokenizers' trainer)
"""

import json
import os
import time

from disttrain.data import chat
from disttrain.errors import DataError, one_line_errors

_EOS_NAMES = ('<|endoftext|>', '<|end_of_text|>', '</s>', '<eos>', '<|im_end|>', '<|eot_id|>')
BYTE_EOS = 256


def _need(module: str):
  try:
    return __import__(module)
  except ImportError as e:
    raise DataError(f'data.tokenizer needs the {module} package ({e}); pip install '
                    "'.[text]'") from e


class Tokenizer:
  """encode / decode / vocab_size / eos_id / bos_id of one tokenizer file ('' = bytes)."""

  def __init__(self, path: str = ''):
    self.path = path
    self._impl = None
    self.kind, file = _resolve(path)
    self.file = file
    self._load()

  def _load(self) -> None:
    if self.kind == 'bytes':
      self.vocab_size, self.eos_id, self.bos_id = 257, BYTE_EOS, None
    elif self.kind == 'hf':
      tokenizers = _need('tokenizers')
      try:
        self._impl = tokenizers.Tokenizer.from_file(self.file)
        # A file saved with them on would cut and pad every document; transformers turns both off.
        self._impl.no_truncation()
        self._impl.no_padding()
      except Exception as e:  # pylint: disable=broad-except  (the Rust side's own errors)
        raise DataError(f'data.tokenizer={self.path!r}: {self.file} is not a tokenizer.json '
                        f'({str(e)[:200]}); pass a Hugging Face tokenizer.json') from e
      self.vocab_size = self._impl.get_vocab_size(with_added_tokens=True)
      self.eos_id, self.bos_id = self._special('eos_token'), self._special('bos_token')
    else:
      spm = _need('sentencepiece')
      self._impl = spm.SentencePieceProcessor()
      try:
        self._impl.Load(self.file)
      except (OSError, RuntimeError) as e:
        raise DataError(f'data.tokenizer={self.path!r}: {self.file} is not a SentencePiece model '
                        f'({e}); pass a .model file') from e
      self.vocab_size = self._impl.GetPieceSize()
      self.eos_id = self._impl.eos_id() if self._impl.eos_id() >= 0 else None
      self.bos_id = self._impl.bos_id() if self._impl.bos_id() >= 0 else None

  def eos_within(self, vocab_size: int) -> int | None:
    """The end-of-text id where a model of `vocab_size` ids can emit it, else None (the byte
    tokenizer's 256 beyond a 256-id model)."""
    return int(self.eos_id) if self.eos_id is not None and self.eos_id < vocab_size else None

  def stop_ids(self, vocab_size: int, model_dir: str | None = None) -> tuple[int, ...]:
    """The ids generation stops at: eos_within first, then generation_config.json's
    eos_token_id (an id or a list, as transformers' generate reads it; without that file,
    config.json's, as transformers derives one) where the model has them. The files are the
    model's: in `model_dir` (a Hugging Face directory) if given, else beside the tokenizer."""
    ids = [i for i in [self.eos_within(vocab_size)] if i is not None]
    folder = model_dir or os.path.dirname(self.file)
    config = next((os.path.join(folder, n) for n in ('generation_config.json', 'config.json')
                   if folder and os.path.isfile(os.path.join(folder, n))), None)
    if config is None:
      return tuple(ids)
    try:
      with open(config, encoding='utf-8') as f:
        listed = json.load(f).get('eos_token_id')
      listed = [] if listed is None else [int(i) for i in (
          listed if isinstance(listed, list) else [listed])]
    except (ValueError, TypeError, AttributeError) as e:
      if os.path.basename(config) == 'config.json':
        return tuple(ids)  # a model's config that says nothing usable: no stop ids from it
      raise DataError(f'{config}: eos_token_id is not an id or a list of ids ({e}); fix or remove '
                      'the file') from e
    return tuple(ids + [i for i in dict.fromkeys(listed) if 0 <= i < vocab_size and i not in ids])

  def _special(self, key: str) -> int | None:
    """A special token's id as named beside the file (chat.special_tokens; eos: else the usual
    names)."""
    name = chat.special_tokens(self.file).get(key)
    if name is not None:
      found = self._impl.token_to_id(name)
      if found is None and key == 'eos_token':  # else 'no end-of-sequence token (none named)'
        raise DataError(f'{os.path.dirname(self.file)} names eos_token {name!r}, which '
                        f'{self.file} does not have; fix the name (tokenizer_config.json, '
                        'special_tokens_map.json) or use the tokenizer it belongs to')
      return found
    if key != 'eos_token':
      return None
    return next((i for i in map(self._impl.token_to_id, _EOS_NAMES) if i is not None), None)

  def __getstate__(self) -> dict:
    return {'path': self.path}

  def __setstate__(self, state: dict) -> None:
    self.__init__(state['path'])

  def encode(self, text: str, special: bool = True) -> list[int]:
    return self.encode_batch([text], special)[0]

  def encode_batch(self, texts: list[str], special: bool = True) -> list[list[int]]:
    """Token ids of each text, no EOS; `special`: with what the tokenizer adds itself (BOS),
    as at the start of a document (not for a later piece of one)."""
    if self.kind == 'bytes':
      return [list(t.encode('utf-8')) for t in texts]
    if self.kind == 'hf':
      return [e.ids for e in self._impl.encode_batch(texts, add_special_tokens=special)]
    ids = self._impl.EncodeAsIds(texts)
    if special and self.bos_id is not None:
      return [[self.bos_id] + x for x in ids]
    return ids

  def encode_pieces(self, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a document's (text, trained) pieces. Their joined text is encoded at
    once (a piece boundary is no token boundary: SentencePiece adds no '▁' per piece), a token
    trained when any of its characters is in a trained piece. Plain pieces get what the
    tokenizer adds (BOS) and a trained EOS; a chat template's (chat.Rendered) neither, as
    `apply_chat_template` encodes its text."""
    if isinstance(pieces, chat.Rendered):
      return self.encode_whole(pieces)
    ids, mask = self._joined(pieces, special=True)
    if self.ends_with_eos(ids):  # the tokenizer's post-processor added it ('$A </s>'): trained
      return ids, mask[:-1] + [1]
    return ids + [self.eos_id], mask + [1]

  def ends_with_eos(self, ids: list[int]) -> bool:
    """Whether encoding with specials already ended a document with EOS (a post-processor
    '$A </s>': T5, Llama with add_eos_token), so nothing is appended a second time."""
    return self.kind == 'hf' and bool(ids) and ids[-1] == self.eos_id

  def encode_whole(self, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a chat template's rendered text, encoded with no added specials."""
    if self.kind != 'hf':
      raise DataError(f'data.tokenizer={self.path!r}: chat templates need a Hugging Face '
                      'tokenizer.json (character offsets); pass the directory that holds one, or '
                      'set data.sft.chat_template=plain')
    return self._joined(pieces, special=False)

  def _joined(self, pieces, special: bool) -> tuple[list[int], list[int]]:
    import numpy as np  # pylint: disable=g-import-not-at-top
    text = ''.join(t for t, _ in pieces)
    if self.kind == 'bytes':  # one id per byte: the pieces' bytes are the text's
      return (list(text.encode('utf-8')),
              [int(k) for t, k in pieces for _ in range(len(t.encode('utf-8')))])
    trained = np.concatenate([np.full(len(t), bool(k), np.int64) for t, k in pieces] + [[0]])
    counts = np.concatenate([[0], np.cumsum(trained)])
    if self.kind == 'hf':
      encoding = self._impl.encode(text, add_special_tokens=special)
      return list(encoding.ids), [int(counts[end] > counts[start])
                                  for start, end in encoding.offsets]
    # Character offsets (sentencepiece >= 0.2.2); byte fallback's leading bytes have empty spans.
    encoding = self._impl.encode(text, return_type='offset_mapping')
    ids = list(encoding['ids'])
    mask = [int(trained[start] if start == end else counts[end] > counts[start])
            for start, end in encoding['offsets']]
    if special and self.bos_id is not None:
      ids, mask = [self.bos_id] + ids, [0] + mask
    return ids, mask

  def decode(self, ids: list[int]) -> str:
    ids = [int(i) for i in ids]
    if self.kind == 'bytes':
      return bytes(i for i in ids if i < 256).decode('utf-8', errors='replace')
    if self.kind == 'hf':
      return self._impl.decode(ids)
    return self._impl.DecodeIds(ids)

  def continuation(self, prompt: list[int], new: list[int]) -> str:
    """The text `new` adds after `prompt`: decoded together, as a word-initial '▁' (SentencePiece,
    Metaspace) decodes to a space only inside a text, else `new` alone."""
    before, whole = self.decode(prompt), self.decode(list(prompt) + list(new))
    return whole[len(before):] if whole.startswith(before) else self.decode(new)

  def id_to_token(self, i: int) -> str:
    if self.kind == 'bytes':
      return '<eos>' if i == BYTE_EOS else chr(i)
    return self._impl.id_to_token(i) if self.kind == 'hf' else self._impl.IdToPiece(i)

  def check_vocab(self, vocab_size: int) -> None:
    """Refuses a tokenizer whose ids would not fit the model's vocabulary."""
    if self.vocab_size > vocab_size:
      raise DataError(f'data.tokenizer={self.path or "bytes"!r} has {self.vocab_size:,} tokens '
                      f'but model.vocab_size={vocab_size:,}; raise model.vocab_size to at least '
                      f'{self.vocab_size} or use a smaller tokenizer')


def _resolve(path: str) -> tuple[str, str]:
  """('bytes' | 'hf' | 'sentencepiece', file)."""
  if not path:
    return 'bytes', ''
  if os.path.isdir(path):
    for name, kind in (('tokenizer.json', 'hf'), ('tokenizer.model', 'sentencepiece')):
      if os.path.isfile(os.path.join(path, name)):
        return kind, os.path.join(path, name)
    raise DataError(f'data.tokenizer={path!r} is a directory without tokenizer.json or '
                    'tokenizer.model; pass the tokenizer file')
  if not os.path.isfile(path):
    raise DataError(f'data.tokenizer={path!r} does not exist; pass a tokenizer.json, a '
                    "SentencePiece .model, or '' for bytes")
  return ('sentencepiece' if path.endswith('.model') else 'hf'), path


def load(path: str = '') -> Tokenizer:
  return Tokenizer(path)


def train_bpe(texts, vocab_size: int, out: str) -> Tokenizer:
  """A byte-level BPE tokenizer (GPT-2's scheme, `tokenizers`' trainer) with <|endoftext|> as
  token 0 and end of sequence; written to `out` (tokenizer.json)."""
  tokenizers = _need('tokenizers')
  # pylint: disable-next=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=['<|endoftext|>'],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  tok.save(out)
  return Tokenizer(out)


def main(argv: list[str]) -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  from disttrain import commandline  # pylint: disable=g-import-not-at-top
  from disttrain.data import text  # pylint: disable=g-import-not-at-top
  del argv
  commandline.output_file('out', flags.FLAGS.out)
  start = time.perf_counter()
  docs = text.Documents(text.resolve(flags.FLAGS.input, '--input'), flags.FLAGS.text_field)
  try:
    tok = train_bpe((docs[i] for i in range(len(docs))), flags.FLAGS.vocab_size, flags.FLAGS.out)
  except DataError as e:  # a line without the field: the fix is this command's flag
    raise DataError(commandline.in_flags(str(e), {text.FIELD_SETTINGS: '--text_field'})) from e
  print(f'trained a {tok.vocab_size:,}-token byte-level BPE tokenizer on {len(docs):,} documents '
        f'in {time.perf_counter() - start:.1f}s: {flags.FLAGS.out} (eos id {tok.eos_id})')


if __name__ == '__main__':
  from absl import flags  # pylint: disable=g-import-not-at-top
  from disttrain import commandline  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string('input', None, 'Text files: .txt, .jsonl or .parquet globs, comma-separated.')
  flags.DEFINE_string('text_field', 'text', 'JSONL field / Parquet column with the text.')
  flags.DEFINE_integer('vocab_size', 4096, 'Tokens in the vocabulary (special token included): '
                       'at least the 256 bytes and <|endoftext|>.', lower_bound=257)
  flags.DEFINE_string('out', None, 'Where to write tokenizer.json.')
  flags.mark_flags_as_required(['input', 'out'])
  commandline.run(one_line_errors(main))
