"""Where processes come from: the local launcher, the Ray launcher and the one worker entry."""
