"""Keras 3 adapter (JAX backend): `stateless_call` behind the protocol of disttrain/models/linen.py.

Keras is an optional extra (`pip install .[keras]`). Keras picks its backend when it is first
imported, so this module sets KERAS_BACKEND=jax unless it is already set; import disttrain (or
this module) before keras, or export KERAS_BACKEND=jax yourself. Any other backend is refused.

  params                    trainable variables, a dict keyed by variable path ('dense/kernel')
  mutable['non_trainable']  non-trainable variables (BatchNormalization moving statistics)
  model_loss                the sum of the `add_loss` losses of the call (return_losses=True)
Seed-generator states (what keras Dropout draws from) are not stored: every call gets fresh ones
derived from the step's rng, so dropout follows the step's key rules like the other front ends.

Keras owns initialisation: the initial values are those the Keras model was built with, so seed
its initializers (or call keras.utils.set_random_seed first) to make every process build the
same values; the config's seed drives dropout and data order. A builder runs in a fresh thread
(see keras_model), where Keras' thread-local settings (set_random_seed, dtype policy) made in the
caller's thread do not apply: make them inside the builder.

Losses over a split batch: each call of the model (a device's rows in shard_map/pmap, a
micro-batch under grad_accum_steps) sees part of the batch, so the step scales each call's model
loss by its share and sums, which is exact for losses that are means over rows (Keras' own
activity regularizers divide by the batch size) but not for sums over rows. The model says which
it has with `loss_reduction`: 'mean', 'sum' (each call's sum enters whole, so the calls add up to
the global sum), or None (unknown: refused in shard_map/pmap when the model adds losses; in jit
style without accumulation every call sees the global batch, so all three are exact there).
"""

import concurrent.futures
import dataclasses
import os
from typing import Any, Callable

os.environ.setdefault('KERAS_BACKEND', 'jax')

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import keras  # pylint: disable=g-import-not-at-top,wrong-import-position

from disttrain.errors import ConfigError  # pylint: disable=g-import-not-at-top
from disttrain.models.linen import InputKey, model_inputs  # pylint: disable=g-import-not-at-top

if keras.backend.backend() != 'jax':
  raise ConfigError(f'keras was imported with backend {keras.backend.backend()!r}; disttrain '
                    'needs KERAS_BACKEND=jax set before keras is first imported')

_REDUCTIONS = (None, 'mean', 'sum')


def _is_seed_state(variable) -> bool:
  # keras.random.SeedGenerator keeps its state in a variable of this name.
  return variable.path.endswith('seed_generator_state')


@dataclasses.dataclass(frozen=True)
class KerasModel:
  """Wraps a built `keras.Model`, or `build(input_shape) -> keras.Model` called once per shape.

  With a tuple of input keys the model gets a list of inputs, and `build` a tuple of shapes.
  """
  model: Any  # keras.Model, or a callable taking one example's shape (no batch axis)
  input_key: InputKey = 'image'
  loss_reduction: str | None = None  # how add_loss losses reduce over rows (see module doc)
  batch_axes: Any = None  # set by with_batch_axes (shard_map/pmap)
  _built: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def __post_init__(self):
    if self.loss_reduction not in _REDUCTIONS:
      raise ConfigError(f'loss_reduction={self.loss_reduction!r} is not one of {_REDUCTIONS}; '
                        "say 'mean' or 'sum' for how the model's add_loss losses reduce over rows")

  def keras_model(self, input_shape: tuple) -> keras.Model:
    """The keras.Model for one example shape, built (outside any trace) on first use."""
    if isinstance(self.model, keras.Model):
      return self.model
    if input_shape not in self._built:
      # Keras needs eager JAX to create its variables, but state creation first asks from inside
      # jax.eval_shape / jit. JAX's trace state is per thread: build in a fresh thread.
      with concurrent.futures.ThreadPoolExecutor(1) as pool:
        self._built[input_shape] = pool.submit(self.model, tuple(input_shape)).result()
    return self._built[input_shape]

  def _input_shape(self, inputs: tuple) -> tuple:
    shapes = tuple(tuple(x.shape[1:]) for x in inputs)
    return shapes[0] if isinstance(self.input_key, str) else shapes

  def init(self, rng: jax.Array, batch: dict) -> dict:
    """The Keras model's own initial values (rng unused: Keras owns initialisation)."""
    del rng
    model = self.keras_model(self._input_shape(model_inputs(batch, self.input_key)))
    variables = {'params': _by_path(model.trainable_variables)}
    non_trainable = [v for v in model.non_trainable_variables if not _is_seed_state(v)]
    if non_trainable:
      variables['non_trainable'] = _by_path(non_trainable)
    return variables

  def apply(self, variables: dict, batch: dict, *, train: bool, rng: jax.Array | None):
    """stateless_call -> (outputs, {'non_trainable': new values}, sum of add_loss losses)."""
    inputs = model_inputs(batch, self.input_key)
    model = self.keras_model(self._input_shape(inputs))
    x = inputs[0] if isinstance(self.input_key, str) else list(inputs)
    params, stored = variables['params'], variables.get('non_trainable', {})
    base = jax.random.key(0) if rng is None else rng  # eval: dropout is off, any seed will do
    non_trainable = [jax.random.key_data(jax.random.fold_in(base, i)) if _is_seed_state(v)
                     else stored[v.path] for i, v in enumerate(model.non_trainable_variables)]
    outputs, new_values, losses = model.stateless_call(
        [params[v.path] for v in model.trainable_variables], non_trainable, x, training=train,
        return_losses=True)
    new = {v.path: value for v, value in zip(model.non_trainable_variables, new_values)
           if not _is_seed_state(v)}
    return outputs, ({'non_trainable': new} if new and train else {}), self._model_loss(losses)

  @property
  def model_loss_sums_rows(self) -> bool:
    """The step adds each call's (device's, micro-batch's) model loss whole, not its share."""
    return self.loss_reduction == 'sum'

  def _model_loss(self, losses: list) -> jax.Array:
    if losses and self.batch_axes is not None and self.loss_reduction not in ('mean', 'sum'):
      raise ConfigError('the Keras model adds losses (add_loss) but loss_reduction is None, so '
                        'shard_map/pmap cannot combine per-device losses exactly; pass '
                        "KerasModel(..., loss_reduction='mean' or 'sum') or use step_mode=jit")
    return sum((jnp.asarray(l, jnp.float32) for l in losses), jnp.float32(0.0))

  def logical_specs(self, batch: dict) -> None:
    """Keras variables carry no logical axis names: use param_rules on their paths."""
    del batch

  def with_batch_axes(self, axes) -> 'KerasModel':
    """For shard_map/pmap: remembers the batch axes, which sum-reduced losses need."""
    return dataclasses.replace(self, batch_axes=axes, _built=self._built)

  def check_batch_axes(self, variables: dict) -> None:
    """Refuses per-device statistics: Keras BatchNormalization has no cross-device reduction."""
    if set(variables) - {'params'}:
      raise ConfigError('the Keras model has non-trainable statistics (e.g. BatchNormalization) '
                        'that shard_map/pmap would compute per device; use step_mode=jit')


def _by_path(variables: list) -> dict:
  """{variable.path: value}; paths are unique within a Keras model."""
  values = {v.path: v.value for v in variables}
  if len(values) != len(variables):
    raise ConfigError('the Keras model has variables with the same path; give its layers '
                      'distinct names')
  return values


@dataclasses.dataclass(frozen=True)
class KerasTask:
  """A task from a Keras loss and Keras metric functions, averaged over the global batch.

  `loss` must return one value per example (construct it with reduction=None); `metrics` maps a
  name to a per-example function such as keras.metrics.sparse_categorical_accuracy. With
  `num_classes`, labels are one-hot encoded first (CategoricalCrossentropy, categorical_accuracy).
  """
  loss: Callable[[jax.Array, jax.Array], jax.Array]
  metrics: dict = dataclasses.field(default_factory=dict)
  num_classes: int = 0  # > 0: one-hot labels (seed 000's to_categorical)
  label_key: str = 'label'

  def per_example(self, outputs: jax.Array, batch: dict) -> dict[str, jax.Array]:
    """{'loss': [B], <metric>: [B], ...}."""
    labels = batch[self.label_key]
    if self.num_classes:
      labels = jax.nn.one_hot(labels, self.num_classes)
    values = {'loss': self.loss(labels, outputs)}
    values.update({name: fn(labels, outputs) for name, fn in self.metrics.items()})
    return {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}
