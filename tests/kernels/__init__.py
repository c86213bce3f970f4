"""Tests of the s2attn kernels (kernels/): patterns, layouts, Triton and Gluon passes."""
