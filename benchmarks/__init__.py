"""Benchmarks of the trainer service; run each as a module (python -m benchmarks.trainer_step)."""
