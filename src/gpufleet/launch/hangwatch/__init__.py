"""Hang watching: when a run that stopped moving is hung, and in which words.

``watchdog`` judges (the learned fast limit and ``hang_timeout``), ``activity`` samples what each
rank's process tree does (CPU time, a stopped process, GPU use), ``diagnosis`` words the verdict
from the ranks' progress records and stacks. The controller drives it; every engine feeds it.
"""
