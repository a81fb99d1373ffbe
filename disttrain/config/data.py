"""data.*: which data, where it lives, how it is split and read; per-source groups."""

import dataclasses
from typing import Any

from disttrain.config.checks import one_of, positive
from disttrain.errors import ConfigError

# Sources that read data.train_files, and the built-in ones that read none.
FILE_SOURCES = ('array_record', 'tokens', 'documents', 'sft', 'preference', 'prompts')
FILELESS_SOURCES = ('digits', 'mnist', 'synthetic', 'synthetic_tokens', 'text')
PACKING = ('concat', 'documents')
MIXABLE = ('array_record', 'tokens', 'documents', 'sft')  # sources data.mixture can join
TOKEN_DTYPES = ('uint16', 'uint32')


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  """data.name='synthetic': Gaussian features labelled by a fixed linear teacher;
  'synthetic_tokens': uniform random token rows of data.seq_len (benchmarks)."""
  examples: int = 8192  # examples in the set (was data.synthetic_examples: deprecated name)
  features: int = 784  # features per example (was data.synthetic_features: deprecated name)

  def __post_init__(self):
    positive('data.synthetic.examples', self.examples)
    positive('data.synthetic.features', self.features)


@dataclasses.dataclass(frozen=True)
class TextConfig:
  """data.name='text': byte windows of the standard library's *.py files (or of data.dir)."""
  bytes: int = 2**21  # bytes of text read, in sorted file order (was data.text_bytes)

  def __post_init__(self):
    positive('data.text.bytes', self.bytes)


@dataclasses.dataclass(frozen=True)
class TokensConfig:
  """data.name='tokens': flat token files (nanoGPT's .bin: raw token ids, no header)."""
  dtype: str = 'uint16'  # uint16 (vocabularies up to 65,536) or uint32

  def __post_init__(self):
    one_of('data.tokens.dtype', self.dtype, TOKEN_DTYPES)


@dataclasses.dataclass(frozen=True)
class SftConfig:
  """data.name='sft': JSON lines of prompt/completion pairs or chat turns (data/text.py)."""
  prompt_field: str = 'prompt'  # the prompt: read, never trained
  completion_field: str = 'completion'  # trained: the loss counts these tokens only
  messages_field: str = 'messages'  # [{"role", "content"}, ...]; assistant turns are trained
  # How chat turns become text: auto (the tokenizer directory's own template, chat_template.jinja
  # or tokenizer_config.json's, else plain), plain ('<|role|>' lines) or a .jinja file
  # (disttrain/data/chat.py).
  chat_template: str = 'auto'


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Which data, where it lives, how it is split and read. Per-source fields sit in groups."""
  # A builder in disttrain.data.sources.SOURCES: digits (scikit-learn's 1,797 real 8x8 digits),
  # mnist (IDX files in data.dir), synthetic (benchmarks), text (byte windows), and from
  # data.train_files: array_record, tokens, documents (raw text), sft (prompt/completion or chat),
  # preference (prompt/chosen/rejected pairs for DPO), prompts (GRPO: a prompt and the fields
  # its rewards read).
  name: str = 'digits'
  # mnist: a folder with train-*/t10k-* IDX files (gzipped or not); text: a folder of text files
  # ('' = the standard library's *.py).
  dir: str = ''
  # array_record / tokens / documents / sft / preference / prompts: comma-separated local file
  # globs.
  train_files: str = ''
  # The eval split's file globs; '' = hold out data.eval_examples of the train files (documents:
  # whole documents).
  eval_files: str = ''
  # Examples held out for eval when the source has no separate eval split (the last N in file
  # order). -1 = the source's default: 297 (digits), 2000 (mnist with only the t10k pair), 1024
  # (synthetic), 256 (text), 0 (files).
  eval_examples: int = -1
  # Downstream evaluations of a language model, run with each eval: 'NAME=PATH;NAME=PATH' (a
  # config file may give ((name, path), ...)), each PATH local JSON lines of multiple-choice
  # {"context", "choices", "answer"} or generation {"prompt", "answer"} examples; records
  # NAME/accuracy, NAME/accuracy_norm or NAME/exact_match (disttrain/evaluation/).
  eval_tasks: Any = ''
  eval_max_new_tokens: int = 64  # generation tasks: greedy tokens per prompt at most
  # lm-evaluation-harness tasks run with each eval, comma-separated names (pip install lm_eval);
  # records <task>/<metric> as the harness names them (acc, acc_norm, exact_match, ...).
  eval_harness: str = ''
  eval_harness_limit: int = 0  # examples per harness task at most; 0 = all
  eval_harness_include: str = ''  # a directory of your own YAML tasks for data.eval_harness
  seq_len: int = 128  # language-model data: tokens per row (targets are the next tokens)
  workers: int = 0  # worker processes that read and transform train batches; 0 = a thread
  # Global batches read ahead of the step in a thread; -1 = 0 on CPU devices (XLA's step uses
  # every core: a reader thread slowed it down, measured), 2 on accelerators.
  prefetch: int = -1
  # documents / sft: raw text tokenized with a Hugging Face tokenizer.json (or a directory with
  # one) or a SentencePiece .model; '' = bytes (end of sequence 256).
  tokenizer: str = ''
  # documents / sft / tokens: concat (joined, cut into windows) or documents (whole documents in
  # rows by best fit, with segment_ids and positions; token files need the converter's .docs.npy).
  # '' = documents for sft (a fine-tuning example is never cut across rows), concat otherwise.
  packing: str = ''
  text_field: str = 'text'  # documents: the JSONL field / Parquet column holding the text
  # Several sources of data.name's kind in proportion: 'web=GLOB:0.7;code=GLOB:0.3' (the weight
  # after each source's last colon; a config file may give ((name, glob, weight), ...)); rows
  # come from a deterministic schedule of the weights (disttrain/data/mixture.py). '' = one
  # source, data.train_files. Replaces data.train_files; eval: data.eval_files, or each source's
  # last data.eval_examples as an eval set named after it.
  mixture: Any = ''
  # New weights from a step on (that step's batch included): 'STEP:NAME=WEIGHT,...;...' (or
  # ((step, {name: weight}), ...)); a source left out gets weight 0. The steps before the first
  # stage use data.mixture's weights.
  mixture_stages: Any = ''
  # A mixture source that has given every row: repeat (its next epoch, counted per source) or
  # stop (the run ends with a checkpoint at the last step before that).
  mixture_exhausted: str = 'repeat'
  synthetic: SyntheticConfig = SyntheticConfig()
  text: TextConfig = TextConfig()
  tokens: TokensConfig = TokensConfig()
  sft: SftConfig = SftConfig()

  def __post_init__(self):
    if self.packing:
      one_of('data.packing', self.packing, PACKING)
    # data.name is checked against disttrain.data.sources.SOURCES when the data is built.
    if self.name == 'mnist' and not self.dir:
      raise ConfigError("data.name='mnist' needs data.dir; pass --config.data.dir=PATH/TO/MNIST")
    one_of('data.mixture_exhausted', self.mixture_exhausted, ('repeat', 'stop'))
    if self.mixture and self.name not in MIXABLE:
      raise ConfigError(f'data.mixture mixes sources of data.name in {MIXABLE}, not '
                        f'{self.name!r}; pick one of them or drop data.mixture')
    if self.mixture and self.train_files:
      raise ConfigError('data.mixture and data.train_files are both set; the mixture names its '
                        'own files, so drop data.train_files')
    if self.mixture_stages and not self.mixture:
      raise ConfigError('data.mixture_stages needs data.mixture (the sources whose weights it '
                        "changes); set data.mixture='NAME=GLOB:WEIGHT;...'")
    if self.name in FILELESS_SOURCES and (self.train_files or self.eval_files):
      raise ConfigError(f'data.name={self.name!r} reads no data.train_files or eval_files (it '
                        f'would ignore them); pick a file source {FILE_SOURCES} or drop them')
    if self.name in FILE_SOURCES and not self.train_files and not self.mixture:
      raise ConfigError(f'data.name={self.name!r} needs data.train_files; pass '
                        '--config.data.train_files=GLOB (comma-separate several)')
    if self.eval_examples < -1:
      raise ConfigError(f'data.eval_examples={self.eval_examples} must be -1 (the source\'s '
                        'default), 0 (no eval) or the examples to hold out; pass one')
    positive('data.seq_len', self.seq_len)
    positive('data.eval_max_new_tokens', self.eval_max_new_tokens)
    positive('data.eval_harness_limit', self.eval_harness_limit, allow_zero=True)
    positive('data.workers', self.workers, allow_zero=True)
    if self.prefetch < -1:
      raise ConfigError(f'data.prefetch={self.prefetch} must be -1 (auto) or >= 0; pass one')

  @property
  def packed_as(self) -> str:
    """data.packing with '' resolved: what the run does (the console's data line says it)."""
    return self.packing or ('documents' if self.name == 'sft' else 'concat')
