"""``mergekit-darts sweep``: a grid of merges × surgery variants × seeds run as Ray tasks, resumable."""
