"""What a plan records and reports: the plan and its JSON, the per-node report, the export, the
measurement of real training steps and their timing."""
