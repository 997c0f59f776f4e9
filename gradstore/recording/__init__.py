"""Everything that runs inside a training step, on the training thread (and autograd's device threads).

recorder (the `record` scope), intercept (every backward pass), graph (the walk and node keys), modules
(module attribution), frames (user-code lines), passes (one pass: Python hooks, end of pass), native and
kernels/hooks.cpp (the C++ hooks), stats, kernel and kernels/reduce.c, checksum (measurements), rows (a
pass's rows, built lazily on the writer thread), saved (a Node's saved tensors), options, function_apply
(listening to custom Function calls), torch_private (every private PyTorch API, in one place).
"""
