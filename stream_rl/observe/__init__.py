"""Looking at runs: `status`, `runs`, `report` and the plots."""
