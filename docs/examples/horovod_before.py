"""A Horovod training script as Horovod's own TensorFlow 2 example writes it, in Keras 3 terms: hvd.init, a
per-worker batch, the learning rate scaled by the number of workers, gradients averaged over the workers,
variables broadcast from rank 0. Under Keras 3 neither `horovod.tensorflow.keras` nor `hvd.DistributedGradientTape`
works (horovod#4290: "'Variable' object has no attribute 'ref'"), so this is the loop that remains.
docs/migrating.md sets it next to horovod_after.py, which trains to the same weights.

Run: tfdist launch --backend horovod -n 2 -- python docs/examples/horovod_before.py weights.npz
"""

import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import tfdist

hvd.init()
arrays = tfdist.data.load_arrays("mnist")
x, y = arrays.x_train[:1024], arrays.y_train[:1024]
per_worker_batch = 32
dataset = tf.data.Dataset.from_tensor_slices((x, y)).shard(hvd.size(), hvd.rank()).batch(per_worker_batch)

model = tfdist.models.cnn(filters=(8, 16), dense_units=32)
optimizer = keras.optimizers.SGD(0.01 * hvd.size())  # Horovod's rule: scale the rate with the workers
loss_fn = keras.losses.SparseCategoricalCrossentropy()
optimizer.build(model.trainable_variables)
for variable in model.variables + optimizer.variables:  # every rank starts from rank 0's values
    variable.assign(hvd.broadcast(variable.value, root_rank=0))


@tf.function
def train_step(images, labels):
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
    gradients = tape.gradient(loss, model.trainable_variables)
    gradients = hvd.grouped_allreduce(gradients, op=hvd.Average)  # the mean over the workers
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss


for images, labels in dataset:
    loss = train_step(images, labels)
if hvd.rank() == 0:
    print(f"last loss {float(loss):.4f}")
    np.savez(sys.argv[1], *model.get_weights())
