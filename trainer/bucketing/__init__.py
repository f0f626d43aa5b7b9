"""Internals of the bucket planner (`trainer.buckets` is the public face): the expected-padding
model of the sampler's greedy packer, the segmentation DP, and the strategy comparison."""
