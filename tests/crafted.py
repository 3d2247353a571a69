"""What a crafted pickle holds, for the tests of files that must be refused without running them."""


class Payload:
    """Unpickling it calls `open(marker, "w")`: it runs the file's code, which the marker file would show."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))
