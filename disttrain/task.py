"""What is being learned: per-example losses and metrics from model outputs and a batch.

The step reduces every per-example value as sum(value * mask) over the *global* batch, divided by
the global number of valid examples: never a mean of per-device means.
"""

import jax
import jax.numpy as jnp
import optax


class Classification:
  """Softmax cross-entropy on integer labels; accuracy."""

  def per_example(self, logits_BxC: jax.Array, batch: dict) -> dict[str, jax.Array]:
    labels_B = batch['label']
    loss_B = optax.softmax_cross_entropy_with_integer_labels(logits_BxC.astype(jnp.float32),
                                                             labels_B)
    correct_B = (jnp.argmax(logits_BxC, axis=-1) == labels_B).astype(jnp.float32)
    return {'loss': loss_B, 'accuracy': correct_B}
