"""Model updates: the bundle store with its atomic symlinks, the install flow, probation.
"""
