"""What a job says when it goes wrong: the collective monitor (which ranks never arrived, and where they are),
the flight recorder (each rank's last collectives, written on a failure) and the store calls they make, which
give up after a bound so that the diagnosis never waits on what it diagnoses."""
