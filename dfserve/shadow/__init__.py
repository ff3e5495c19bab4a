"""Shadow records: every mirrored request's answers from each arm, written as a run the verdict core can judge."""
