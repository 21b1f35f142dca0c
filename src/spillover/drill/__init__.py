"""``spillover drill``: replay traffic while squeezing the GPU, record a history, check it."""
