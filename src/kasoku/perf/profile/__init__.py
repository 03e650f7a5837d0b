"""Where a step's time goes: profiles of training steps and what they say.

Today: ``kernels``, the device (or CPU operator) time of profiled steps split by kind --
convolutions and matrix products, Triton (compiled) code, the optimizer, copies -- as ``kasoku
bench --kernels`` records it. The trace analysis, the phase timers and the bottleneck verdict
of ``kasoku profile`` are to be built here, on torch.profiler.
"""
