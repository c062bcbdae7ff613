"""A transactional test stage run as a subprocess: copies Problems from --input to --output,
one Kafka transaction per batch, sleeping --delay seconds per batch so a test can kill it
mid-input. Usage: python copy_stage.py BOOTSTRAP INPUT OUTPUT GROUP TXN_ID DELAY"""

from __future__ import annotations

import sys
import time

from stream_rl.contracts import Problem
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.stage import Incoming, Output, Reject, StageLoop, StopFlag


def main() -> None:
    bootstrap, inp, out, group, txn_id, delay = sys.argv[1:7]

    def handle(batch: list[Incoming[Problem]]) -> list[Output | Reject]:
        time.sleep(float(delay))
        return [Output(out, item.value, key=item.value.problem_id) for item in batch]

    stop = StopFlag()
    stop.install_signal_handlers()
    loop = StageLoop(
        name="copy",
        transport=KafkaTransport(bootstrap),
        group=group,
        input_topic=inp,
        input_type=Problem,
        handle=handle,
        dlq_topic=inp + ".dlq",
        transactional_id=txn_id,
        batch_size=5,
        stop=stop,
    )
    print("started", flush=True)
    stats = loop.run(idle_timeout_s=3.0)
    print(f"done {stats.records_in}", flush=True)


if __name__ == "__main__":
    main()
