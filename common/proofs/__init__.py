"""What --check full proves beyond the launch check's fast items, a feature: that a run resumed from its checkpoint
trains the step the uninterrupted run trains (resume_proof, two short child runs of the command line). Loaded only
under --check full (common.check.prove_resume)."""
