"""TPU kernels (Pallas, Mosaic): ragged paged attention over the merged KV page layout of kernels/tpu/layout.py,
and the group-wise int8 matmul (int8_matmul.py).
Imports none of our packages but kernels."""
