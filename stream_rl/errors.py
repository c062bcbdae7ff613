"""The small error hierarchy every stage raises. The CLI turns these into one-line messages."""


class StreamRLError(Exception):
    """Base class: an error a user can act on. Its message says what to do."""


class ConfigError(StreamRLError):
    """Invalid configuration: names the bad key and why."""


class ContractError(StreamRLError):
    """A record does not match its Avro contract (undecodable, unknown schema, invalid field)."""


class KafkaError(StreamRLError):
    """The broker or a Kafka client failed (unreachable, delivery failed, transaction aborted)."""


class TransactionAborted(KafkaError):
    """A transaction had to be aborted (the broker went away in the middle of it): nothing of it
    is visible downstream; the consumer must go back to its committed offsets."""


class BrokerError(KafkaError):
    """The local broker could not be fetched, started or stopped."""


class WeightSyncError(StreamRLError):
    """A weight broadcast or a server's weight update failed."""


class InferenceError(StreamRLError):
    """An inference request could not be served (server down, engine failure, timeout, an
    answer that is not what the engine's API promises): the server's fault, counted against it."""


class ServerBusy(InferenceError):
    """The server answered that it cannot take the request *now* and that it is safe to retry
    (vLLM 0.33's HTTP 503 while generation is paused for a weight update in `wait` mode, or while
    its queue is full): back-pressure, not a failure. The caller retries after a backoff without
    counting it against the server."""


class BadRequestError(InferenceError):
    """The server refused the request itself as invalid (HTTP 400, 413 or 422: a prompt longer
    than the model's context, a sampling option out of range): the request's fault, not the
    server's. The actor sends its problem to the DLQ with the server's message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class TaskError(StreamRLError):
    """A task is unknown or misconfigured."""
