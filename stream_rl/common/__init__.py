"""What every layer may use: model loading, Prometheus metrics, duplicate windows, heap settling."""
