"""horovod_before.py moved to tfdist: the same training with Keras' `fit` under `tfdist.HorovodStrategy`, to the
same weights. What changed is listed in docs/migrating.md.

Run: tfdist launch --backend horovod -n 2 -- python docs/examples/horovod_after.py weights.npz
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist

strategy = tfdist.HorovodStrategy()  # hvd.init, device pinning, broadcast of every variable at creation
arrays = tfdist.data.load_arrays("mnist")
x, y = arrays.x_train[:1024], arrays.y_train[:1024]
workers = strategy.num_replicas_in_sync
global_batch = 32 * workers  # Keras batches globally: each worker gets its slice of every batch
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)

with strategy.scope():
    model = tfdist.models.cnn(filters=(8, 16), dense_units=32)
    model.compile(optimizer=keras.optimizers.SGD(0.01 * workers), loss="sparse_categorical_crossentropy")
history = model.fit(dataset, epochs=1, verbose=0)  # gradients averaged by Horovod; metrics averaged too
if strategy.is_chief:
    print(f"last loss {history.history['loss'][-1]:.4f}")
    np.savez(sys.argv[1], *model.get_weights())
