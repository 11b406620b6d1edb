"""The Recorder's device path: CUDA tensors snapshotted into a pinned ring by one kernel launch, harvested later."""
