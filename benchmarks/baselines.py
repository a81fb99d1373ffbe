"""The sides of every comparison: disttrain's step or loop, and what they are timed against.

StepSide times any step function window by window and refuses a window in which it compiled;
LoopSide times the whole disttrain.train loop.
The hand-written jax.jit + optax step and the Keras 3 fit are written plainly on purpose: the code
a careful user would write by hand for one model on one layout, so a ratio measures what
disttrain costs or saves, not how the model is written.
"""

import contextlib
import dataclasses
import io
import os
import statistics
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

import disttrain
from disttrain.data.records import MASK


class BenchError(Exception):
  """A bad flag combination or an invalid measurement; printed as one line."""


class RecompileError(BenchError):
  """A step compiled inside a timed window: the figure would time the compiler."""


@dataclasses.dataclass
class StepSide:
  """A jitted step, its state and inputs; calling it runs one timed window of `steps` steps.

  With `logged_fn`, every `log_every`-th call (counted across windows) runs it instead of `fn`,
  as disttrain's loop runs its full-metrics step on the steps that end a train record.
  """
  name: str
  fn: object  # (state, inputs[i]) -> (state, outputs)
  state: object
  inputs: list
  steps_per_call: int
  bound: bool  # CPU mesh of > 1 device: wait for call N-1 after dispatching call N
  traces: Callable[[], int]  # how often the side's functions were traced so far
  compiles: list  # [n]: compilations (and compilation-cache reads) in this process
  steps: int = 0
  logged_fn: object = None
  log_every: int = 0  # calls
  calls: int = 0

  def call(self, i: int):
    """One call on inputs[i]; returns its outputs."""
    self.calls += 1
    logged = self.logged_fn is not None and self.calls % self.log_every == 0
    self.state, out = (self.logged_fn if logged else self.fn)(self.state,
                                                              self.inputs[i % len(self.inputs)])
    return out

  def __call__(self) -> float:
    """Seconds for `steps` steps, all finished; raises RecompileError if anything compiled."""
    traces, compiles = self.traces(), self.compiles[0]
    previous = out = None
    start = time.perf_counter()
    for i in range(self.steps // self.steps_per_call):
      out = self.call(i)
      if self.bound and previous is not None:
        jax.block_until_ready(previous)
      previous = out
    jax.block_until_ready((self.state, out))
    seconds = time.perf_counter() - start
    if self.traces() != traces or self.compiles[0] != compiles:
      raise RecompileError(f'{self.name} traced {self.traces() - traces} and compiled '
                           f'{self.compiles[0] - compiles} time(s) during a timed window; a '
                           'step must compile once (check shapes, shardings, weak types)')
    return seconds

  def first_call(self) -> tuple[float, object]:
    """Seconds of the first call of each function (trace + compile + one run), and the outputs
    of the first (the logged function's, if there is one)."""
    start = time.perf_counter()
    fns = [self.fn] if self.logged_fn is None else [self.logged_fn, self.fn]
    outs = []
    for fn in fns:
      self.state, out = fn(self.state, self.inputs[0])
      outs.append(jax.block_until_ready(out))
    return time.perf_counter() - start, outs[0]

  def calibrate(self, seconds: float) -> int:
    """Steps per window so that one window takes about `seconds`."""
    self.steps = 20 * self.steps_per_call
    self()
    return int(np.clip(seconds * self.steps / self(), 10, 20000))


def interleave(sides: list, windows: int) -> list[list[float]]:
  """Seconds per window of each side, in the order a b c, c b a, a b c ... so drift hits all."""
  secs = [[] for _ in sides]
  for w in range(windows):
    order = list(range(len(sides)))
    for i in (order if w % 2 == 0 else order[::-1]):
      secs[i].append(sides[i]())
  return secs


class _Clock:
  """A callback that notes the wall time of every train record (each one fetched its window)."""

  def __init__(self):
    self.times: list[tuple[int, float]] = []

  def on_train_record(self, record: dict) -> None:
    self.times.append((record['step'], time.perf_counter()))


class LoopSide:
  """The whole disttrain.train loop (grain pipeline, metrics, records): one run = one window.

  Each run does 2 x run_steps steps with a train record every run_steps; the wall time between
  the two records (each taken after its window's metrics were fetched, so the device finished
  those steps) is the window: every step's data, dispatch and the loop's own bookkeeping, and one
  record written. It is reported as the seconds `steps` steps take at that rate.
  """

  def __init__(self, cfg, model, devices, steps: int, run_steps: int):
    """Runs will use `cfg` with 2 x run_steps steps, a record every run_steps, in temp folders."""
    self.cfg = dataclasses.replace(cfg, num_train_steps=2 * run_steps, log_every_steps=run_steps)
    self.model, self.devices, self.steps = model, devices, steps
    self.workdirs = tempfile.TemporaryDirectory(prefix='throughput_loop_')
    self.runs = 0

  def __call__(self) -> float:
    """Seconds `steps` steps take at the rate of the second half of a fresh run."""
    self.runs += 1
    workdir = f'{self.workdirs.name}/run{self.runs}'  # fresh: train() resumes from checkpoints
    clock = _Clock()
    with contextlib.redirect_stdout(io.StringIO()):
      result = disttrain.train(self.cfg, workdir, model=self.model, devices=self.devices,
                               callbacks=[clock])
    if result.trace_count != 1:
      raise RecompileError(f'the train loop traced its step {result.trace_count} times in one '
                           'run; it must compile once')
    (first, start), (last, end) = clock.times[-2:]
    return self.steps * (end - start) / (last - first)


class HandLoop:
  """The loop a user writes by hand around the hand-written step: a numpy permutation per epoch,
  one fancy-index gather per field and one device_put per batch, in the main thread.

  One call = 2 x run_steps steps; the second half is timed (as LoopSide times its second
  record) and reported as the seconds `steps` steps take at that rate.
  """

  def __init__(self, arrays: dict, batch_size: int, sharding, step, state, steps: int,
               run_steps: int, bound: bool):
    self.arrays, self.batch_size, self.sharding = arrays, batch_size, sharding
    self.step, self.state, self.steps, self.run_steps, self.bound = (step, state, steps,
                                                                     run_steps, bound)
    self.rng = np.random.default_rng(0)
    self.n = len(next(iter(arrays.values())))
    self.mask = np.ones(batch_size, np.float32)

  def __call__(self) -> float:
    perm, pos, previous, start = self.rng.permutation(self.n), 0, None, None
    for i in range(2 * self.run_steps):
      if i == self.run_steps:
        jax.block_until_ready(self.state)
        start = time.perf_counter()
      if pos + self.batch_size > self.n:
        perm, pos = self.rng.permutation(self.n), 0
      index = perm[pos:pos + self.batch_size]
      pos += self.batch_size
      batch = jax.device_put({**{k: v[index] for k, v in self.arrays.items()}, MASK: self.mask},
                             self.sharding)
      self.state, loss = self.step(self.state, batch)
      if self.bound and previous is not None:
        jax.block_until_ready(previous)
      previous = loss
    jax.block_until_ready(self.state)
    return self.steps * (time.perf_counter() - start) / self.run_steps


def numpy_batches(records, batch_size: int, count: int) -> list[dict]:
  """`count` consecutive numpy batches of the records (wrapping around), with all-ones masks."""
  batches = []
  for i in range(count):
    rows = (np.arange(batch_size) + i * batch_size) % len(records)
    batches.append({**records.read(rows), MASK: np.ones(batch_size, np.float32)})
  return batches


_KERNEL = nn.initializers.lecun_normal()
_ZEROS = nn.initializers.zeros_init()


class SmallMLP(nn.Module):
  """The seed-000 model: 784 -> 64 -> 64 -> 10, ReLU; logical axes as disttrain's MnistMLP."""
  hidden: int = 64
  num_classes: int = 10

  @nn.compact
  def __call__(self, x_BxF: jnp.ndarray, train: bool) -> jnp.ndarray:
    del train  # no dropout or BatchNorm
    x = x_BxF.reshape(x_BxF.shape[0], -1)
    in_axis = 'pixels'
    for _ in range(2):
      x = nn.relu(nn.Dense(self.hidden,
                           kernel_init=nn.with_logical_partitioning(_KERNEL, (in_axis, 'hidden')),
                           bias_init=nn.with_logical_partitioning(_ZEROS, ('hidden',)))(x))
      in_axis = 'hidden_in'
    return nn.Dense(self.num_classes,
                    kernel_init=nn.with_logical_partitioning(_KERNEL, ('hidden_in', 'classes')),
                    bias_init=nn.with_logical_partitioning(_ZEROS, ('classes',)))(x)


def train_step_fn(module: nn.Module, tx: optax.GradientTransformation, traces: list,
                  input_key: str = 'image', label_key: str = 'label', dtype=jnp.float32,
                  micro_batches: int = 1, token_weighted: bool = False):
  """(state dict, batch) -> (state dict, loss): mean cross-entropy, Adam, dropout per step.

  The dropout key is fold_in(rng, step), as disttrain's jit style, so in that style both steps
  compute the same numbers (checked before timing). In bf16 the parameters and inputs are cast
  at the start of the loss, as a user writing mixed precision by hand would; with micro-batches
  the batch is cut into M contiguous blocks and lax.scan sums their gradients.
  `token_weighted` (language models): packed rows' positions and segment ids go to the model,
  and the loss is the sum over tokens with a target (>= 0, loss_mask) / their count in the batch.
  Values the module sows into 'losses' (a mixture of experts' router losses) are added.
  """
  cast = lambda tree: jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

  def counted(batch):
    return (batch[label_key] >= 0) & (batch.get('loss_mask', 1) != 0)

  def loss_fn(params, mutable, batch, key, total):
    packed = {k: batch[k] for k in ('positions', 'segment_ids') if k in batch}
    logits, new_mutable = module.apply(
        {'params': cast(params), **mutable}, cast(batch[input_key]), train=True,
        rngs={'dropout': key}, mutable=[*mutable, 'losses'], **packed)
    new_mutable = dict(new_mutable)
    # Values the module sows into 'losses' (an MoE router's) are added to the loss, per call.
    model_loss = sum(jnp.sum(l.astype(jnp.float32))
                     for l in jax.tree.leaves(new_mutable.pop('losses', {}))) / micro_batches
    targets = batch[label_key]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                          jnp.maximum(targets, 0))
    if not token_weighted:
      return ce.mean() + model_loss, new_mutable
    return jnp.sum(jnp.where(counted(batch), ce, 0.0)) / total + model_loss, new_mutable

  def train_step(state: dict, batch: dict):
    traces[0] += 1
    key = jax.random.fold_in(jax.random.wrap_key_data(state['rng']), state['step'])
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    total = jnp.sum(counted(batch)) if token_weighted else None
    if micro_batches == 1:
      (loss, new_mutable), grads = grad_fn(state['params'], state['mutable'], batch, key, total)
    else:
      blocks = jax.tree.map(lambda x: x.reshape((micro_batches, -1) + x.shape[1:]), batch)

      def body(carry, block):
        grads, loss_sum, mutable = carry
        (loss, mutable), g = grad_fn(state['params'], mutable, block, key, total)
        return (jax.tree.map(jnp.add, grads, g), loss_sum + loss, mutable), None
      zeros = jax.tree.map(jnp.zeros_like, state['params'])
      (grads, loss, new_mutable), _ = jax.lax.scan(
          body, (zeros, jnp.float32(0), state['mutable']), blocks)
      if not token_weighted:  # means of equal blocks; token sums are already over the total
        grads = jax.tree.map(lambda g: g / micro_batches, grads)
        loss = loss / micro_batches
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    new_state = dict(state, step=state['step'] + 1, opt_state=opt_state,
                     params=optax.apply_updates(state['params'], updates),
                     mutable=dict(new_mutable))
    return new_state, loss
  return train_step


def jit_step(train_step, state_shardings: dict, batch_sharding: NamedSharding):
  """The hand-written step jitted on the given layout, state donated."""
  replicated = NamedSharding(batch_sharding.mesh, P())
  return jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                 out_shardings=(state_shardings, replicated), donate_argnums=0)


def flops_per_example(train_step, state: dict, batch: dict) -> float:
  """XLA's flop count of one step compiled for one device, divided by the batch size."""
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch))
  cost = jax.jit(train_step).lower(*shapes).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost['flops']) / batch[MASK].shape[0]


class DotPeak:
  """Times n x n jnp.dot products on one device: the matmul peak (float32 on CPU, bf16 else)."""

  def __init__(self, device: jax.Device, products: int = 2):
    """Compiles and warms the product."""
    cpu = device.platform == 'cpu'
    n, self.dtype = (2048, jnp.float32) if cpu else (8192, jnp.bfloat16)
    self.a = jax.device_put(jnp.ones((n, n), self.dtype), device)
    self.matmul = jax.jit(jnp.dot)
    self.matmul(self.a, self.a).block_until_ready()
    self.products, self.flops = products, 2 * n**3 * products

  def __call__(self) -> float:
    """Seconds for `products` products (one timed window)."""
    start = time.perf_counter()
    for _ in range(self.products):
      out = self.matmul(self.a, self.a)
    out.block_until_ready()
    return time.perf_counter() - start


class KerasFit:
  """Keras 3 (JAX backend) `fit` of the seed-000 model: one call = one timed window."""

  def __init__(self, image: np.ndarray, label: np.ndarray, batch_size: int,
               steps_per_execution: int):
    """Builds and compiles the model; raises ImportError when Keras 3 (JAX backend) is missing.
    Set `steps` (per window) before the first call."""
    os.environ.setdefault('KERAS_BACKEND', 'jax')
    import keras  # pylint: disable=g-import-not-at-top  (optional extra)
    if keras.backend.backend() != 'jax':
      raise ImportError(f'Keras runs on {keras.backend.backend()!r}; set KERAS_BACKEND=jax')
    keras.utils.set_random_seed(0)
    self.model = keras.Sequential([
        keras.Input((image.shape[-1],)),
        keras.layers.Dense(64, activation='relu'),
        keras.layers.Dense(64, activation='relu'),
        keras.layers.Dense(10)])
    self.model.compile(optimizer=keras.optimizers.Adam(1e-3),
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       steps_per_execution=steps_per_execution, jit_compile=True)
    self.image, self.label, self.batch_size = image, label, batch_size
    self.steps = 0

  def __call__(self) -> float:
    """Seconds for one `fit` epoch over the window's batches of in-memory numpy arrays."""
    rows = np.arange(self.steps * self.batch_size) % len(self.label)  # wrap around the data
    image, label = self.image[rows], self.label[rows]
    start = time.perf_counter()
    self.model.fit(image, label, batch_size=self.batch_size, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


def median(values) -> float:
  """statistics.median as a float."""
  return float(statistics.median(values))
