"""Weight sync: the trainer broadcasts new weights to the inference servers in flat buckets.

- `buckets`: tensor descriptions (`TensorMeta`) and the wire layout of a bucket.
- `group`: a dedicated process group (gloo on CPU, NCCL on CUDA), never the default group.
- `sender`: the trainer's side (`WeightSender`: join the servers, push versions, drop failures).
- `receiver`: the server's side (`WeightReceiver`: join, receive buckets into shadow buffers).
- `checksum`: `weights_checksum`, the same on both sides for the same bytes.
- `shaping`: smaller pushes (the sender's `push_dtype="server"` cast and `delta_threshold`).
- `adapters`: the same sender interface for vLLM and SGLang servers (GPU only, unverified).
"""

from stream_rl.weights.buckets import TensorMeta, pack_bucket, plan_buckets, unpack_bucket
from stream_rl.weights.checksum import weights_checksum
from stream_rl.weights.receiver import WeightReceiver
from stream_rl.weights.sender import PushReport, WeightSender
from stream_rl.weights.server_client import ServerEndpoint

__all__ = [
    "PushReport",
    "ServerEndpoint",
    "TensorMeta",
    "WeightReceiver",
    "WeightSender",
    "pack_bucket",
    "plan_buckets",
    "unpack_bucket",
    "weights_checksum",
]
