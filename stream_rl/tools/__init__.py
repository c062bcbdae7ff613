"""Offline tools on a run's topics and files: export, track (and the trackers), rescore, replay, make-model (warm start)."""
