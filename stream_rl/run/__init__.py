"""Running a run: the launcher, its children and their supervision, the watchdog and monitor, scaling, servers joining and leaving."""
