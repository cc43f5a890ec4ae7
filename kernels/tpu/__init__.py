"""TPU kernels (Pallas, Mosaic): ragged paged attention over the merged KV page layout of kernels/tpu/layout.py.
Imports none of our packages but kernels."""
