"""The largest micro-batch per device whose compiled train step fits the device's memory.

`find` compiles the loop's train step (from abstract shapes: nothing is created or run) for
candidate micro-batches b, global_batch_size = b x the batch axes' devices x grad_accum_steps,
and holds each to the memory pre-flight (memory.preflight) against the limit less a headroom:
from the config's own micro-batch it doubles while the step fits or halves until it does, then
bisects over multiples of `multiple` between the last fit and the first miss (powers of two alone
by default). A step's memory grows with its micro-batch, not with the accumulation steps.
`disttrain batch-size --config=...` prints what it found (launch/train.py).
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Callable

import jax

from disttrain.config import Config
from disttrain.data import mixture, sources
from disttrain.data.batches import element_spec
from disttrain.errors import ConfigError
from disttrain.hf import config as hf_config
from disttrain.parallel import mesh as mesh_lib
from disttrain.training import memory, setup as run_lib

MOST = 2**16  # the largest micro-batch per device tried: beyond it the cap, not memory, decides


@dataclasses.dataclass(frozen=True)
class Found:
  """The chosen micro-batch per device and what it means for the config."""
  micro_batch: int
  peak_bytes: int  # the chosen step's per-device need (the largest of the loop's variants)
  limit_bytes: int
  limit_source: str  # 'given', 'memory_limit_bytes' or 'device'
  headroom: float  # the fraction of the limit kept free
  budget_bytes: int  # limit_bytes less the headroom: what a candidate must fit
  batch_ways: int  # devices the global batch's rows are split over
  cfg: Config  # the config searched (its global_batch_size and grad_accum_steps as given)
  tried: dict  # micro-batch -> per-device peak bytes, every candidate compiled
  # grad_accum_steps whose compiled step fits the configured batch (0: none tried fits)
  keep: int | None = None

  @property
  def global_batch_size(self) -> int:
    """The largest global batch at the config's grad_accum_steps."""
    return self.micro_batch * self.batch_ways * self.cfg.grad_accum_steps

  def accumulation_for(self, global_batch_size: int) -> int | None:
    """The fewest grad_accum_steps that keep `global_batch_size` within the micro-batch, or
    None (pipelines: their memory grows with the micro-batch count too)."""
    if self.cfg.mesh.stage != 1:
      return None
    rows = global_batch_size // self.batch_ways
    return next(m for m in range(1, rows + 1) if rows % m == 0 and rows // m <= self.micro_batch)

  def lines(self) -> list[str]:
    """What `disttrain batch-size` prints."""
    cfg, ways, m = self.cfg, self.batch_ways, self.cfg.grad_accum_steps
    misses = sorted(b for b, peak in self.tried.items() if peak > self.budget_bytes)
    over = (f'; micro-batch {misses[0]} needs {_bytes(self.tried[misses[0]])}' if misses else
            f'; micro-batches above {MOST} were not tried')  # MOST fit
    out = [f'micro-batch per device: {self.micro_batch}',
           f'compiled train step: {_bytes(self.peak_bytes)} per device{over}',
           f'limit: {self.limit_bytes:,} bytes ({memory.mib(self.limit_bytes)}, '
           f'{self.limit_source}) less {self.headroom:.0%} headroom = {_bytes(self.budget_bytes)}',
           f'largest global batch at grad_accum_steps={m}: {self.micro_batch} x {ways} batch '
           f'devices x {m} = {self.global_batch_size} (--config.global_batch_size='
           f'{self.global_batch_size})']
    keep = self.keep
    if keep:
      out.append(f'global_batch_size={cfg.global_batch_size} as configured fits with '
                 f'--config.grad_accum_steps={keep} (micro-batch '
                 f'{cfg.global_batch_size // ways // keep})')
    elif keep == 0:
      out.append(f'global_batch_size={cfg.global_batch_size} as configured fits with none of the '
                 'grad_accum_steps tried (their accumulated gradients add to the step); split the '
                 'state (fsdp) or recompute activations (model.remat)')
    return out + ['tried: ' + ', '.join(f'{b} ({memory.mib(p)})'
                                        for b, p in sorted(self.tried.items()))]


def _bytes(n: int) -> str:
  return f'{n:,} bytes ({memory.mib(n)})'


def search(fits: Callable[[int], bool], start: int, most: int = MOST, multiple: int = 0) -> int:
  """The largest candidate b <= most with fits(b) (monotone: a larger b never fits better), 0
  when 1 does not fit: from `start` doubling while b fits, else halving until it does, then
  bisection over the multiples of `multiple` between the last fit and the first miss."""
  fit, miss, b = 0, None, max(1, min(start, most))
  while True:
    if fits(b):
      fit = b
      if miss is not None or 2 * b > most:
        break
      b *= 2
    else:
      miss = b
      if fit or b == 1:
        break
      b //= 2
  if not (multiple and fit and miss):
    return fit
  low, high = fit // multiple, -(-miss // multiple)  # low x multiple fits, high x multiple not
  while high - low > 1:
    middle = (low + high) // 2
    low, high = (middle, high) if fits(middle * multiple) else (low, middle)
  return max(fit, low * multiple)


def find(cfg: Config, *, limit: int | None = None, headroom: float = 0.1, multiple: int = 0,
         devices: Sequence[jax.Device] | None = None, model: Any = None, task: Any = None,
         tx: Any = None, train_data: Any = None, say: Callable[[str], None] = lambda _: None
         ) -> Found:
  """The largest micro-batch per device whose train step fits `limit` less `headroom`.

  Args:
    cfg: the run's config; its global_batch_size / (batch devices x grad_accum_steps) is where
      the search starts, and its grad_accum_steps and everything else stay as they are.
    limit: per-device bytes; default cfg.memory_limit_bytes, else the device's bytes_limit.
    headroom: the fraction of the limit kept free (allocator fragmentation, library
      workspaces, what XLA's analysis does not count).
    multiple: bisect over its multiples after the powers of two (0: powers of two only).
    devices, model, task, tx, train_data: as disttrain.train takes them.
    say: gets one line per candidate compiled.

  Raises:
    ConfigError: no limit is given or known (CPU devices report none); GRPO's data.
    MemoryLimitError: not even a micro-batch of 1 fits.
  """
  cfg = hf_config.from_directory(cfg)
  if cfg.step_mode == 'pmap':  # its steps take a placed (per-device stacked) state
    raise ConfigError('step_mode=pmap: the finder compiles jit steps of the same layout; find '
                      'the batch with --config.step_mode=jit (data parallel alike per device)')
  if cfg.data.name == 'prompts':
    raise ConfigError('data.name=prompts: a GRPO step also samples completions, which the '
                      'finder does not compile; find the batch of the same model on its '
                      'training data instead')
  parallel = mesh_lib.Parallelism.from_config(cfg.mesh, devices, cfg.dcn_mesh)
  parallel.check_batch_sizes(cfg)
  source = 'given' if limit else 'memory_limit_bytes' if cfg.memory_limit_bytes else 'device'
  limit = limit or memory.memory_limit(cfg, parallel.mesh)
  if not limit:
    platform = parallel.mesh.devices.flat[0].platform
    raise ConfigError(f'no per-device memory limit to fit: the {platform} devices report none; '
                      'pass --memory_limit=BYTES (or --config.memory_limit_bytes=BYTES)')
  budget = math.floor(limit * (1 - headroom))
  ways, m = parallel.batch_ways, cfg.grad_accum_steps
  if train_data is None:
    train_data = sources.build(cfg)['train_data']
  records = mixture.train_records(train_data, cfg.global_batch_size, cfg.seed)
  spec = element_spec(records)
  tried = {}

  def peak(candidate: Config) -> int:
    plan = run_lib.plan(candidate, spec, devices, model, task, tx)
    try:
      infos, _ = memory.preflight(plan, plan.state, memory.loop_variants(candidate, 0),
                                   lambda _: None, limit=budget)
      return max(info.peak_bytes for info in infos.values())
    except memory.MemoryLimitError as e:
      return e.peak_bytes

  def fits(b: int) -> bool:
    tried[b] = peak(dataclasses.replace(cfg, global_batch_size=b * ways * m))
    say(f'micro-batch {b}: {memory.mib(tried[b])} per device, '
        f'{"fits" if tried[b] <= budget else "does not fit"} {memory.mib(budget)}')
    return tried[b] <= budget

  start = 2 ** int(math.log2(max(1, cfg.global_batch_size // (ways * m))))
  best = search(fits, start, MOST, multiple)
  if not best:
    raise memory.MemoryLimitError(
        f'micro-batch 1 per device needs {memory.mib(tried[1])} but the limit allows '
        f'{memory.mib(budget)} ({memory.mib(limit)} ({source}) less {headroom:.0%} headroom); '
        'split the state (sharding=fsdp with mesh.fsdp), recompute activations '
        '(model.remat=full), or give a larger limit', tried[1])
  found = Found(best, tried[best], limit, source, headroom, budget, ways, cfg, tried)
  return dataclasses.replace(found, keep=_verified_accumulation(found, peak, say))


def _verified_accumulation(found: Found, peak: Callable[[Config], int],
                           say: Callable[[str], None], tries: int = 3) -> int | None:
  """The fewest grad_accum_steps whose compiled step fits the configured global batch: more
  micro-batches add an accumulator of the gradients (and, under fsdp, gathered parameters), so
  the smallest count the micro-batch allows is compiled, then up to `tries` larger ones."""
  cfg, first = found.cfg, found.accumulation_for(found.cfg.global_batch_size)
  if first is None or first == cfg.grad_accum_steps:
    return first  # the configured step: its micro-batch was searched as it is
  rows = cfg.global_batch_size // found.batch_ways
  for m in [d for d in range(first, rows + 1) if rows % d == 0][:tries]:
    need = peak(dataclasses.replace(cfg, grad_accum_steps=m))
    say(f'global_batch_size={cfg.global_batch_size} with grad_accum_steps={m}: '
        f'{memory.mib(need)} per device')
    if need <= found.budget_bytes:
      return m
  return 0
