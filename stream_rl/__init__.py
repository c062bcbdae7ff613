"""stream-rl: PipelineRL-style asynchronous RL post-training as a Kafka streaming dataflow."""

__version__ = "0.1.0"
