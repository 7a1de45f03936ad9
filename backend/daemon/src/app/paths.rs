//! What makes a path of the daemon's unsafe: the problems its directory and file checks
//! find (`private_dir`, `check_own`, `check_ancestors` in the [parent](super)).

/// What makes a path of the daemon's unsafe ([`DaemonError::Unsafe`](super::DaemonError::Unsafe)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathProblem {
    /// A symbolic link where the daemon's own directory or file must be (whoever can change
    /// the link chooses where the daemon writes).
    Symlink,
    /// Not a directory.
    NotDir,
    /// Not a regular file.
    NotFile,
    /// Owned by another user.
    Owner {
        /// Its owner.
        uid: u32,
        /// The daemon's effective uid.
        ours: u32,
    },
    /// Writable by its group or by others.
    Writable {
        /// Its mode.
        mode: u32,
    },
    /// A directory above the daemon's (or a link on the way) owned by another user than
    /// root and the daemon's.
    ParentOwner {
        /// Its owner.
        uid: u32,
    },
    /// A directory above the daemon's writable by its group or by others without the sticky
    /// bit (they can rename the daemon's directory away and put theirs in its place).
    ParentWritable {
        /// Its mode.
        mode: u32,
    },
}

impl std::fmt::Display for PathProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathProblem::Symlink => f.write_str("it is a symbolic link"),
            PathProblem::NotDir => f.write_str("it is not a directory"),
            PathProblem::NotFile => f.write_str("it is not a regular file"),
            PathProblem::Owner { uid, ours } => {
                write!(
                    f,
                    "it is owned by uid {uid}, not by the daemon's uid {ours}"
                )
            }
            PathProblem::Writable { mode } => {
                write!(f, "it is writable by group or others (mode {mode:04o})")
            }
            PathProblem::ParentOwner { uid } => write!(
                f,
                "a directory on the way to the daemon's is owned by uid {uid}, neither root nor the daemon's uid"
            ),
            PathProblem::ParentWritable { mode } => write!(
                f,
                "a directory on the way to the daemon's is writable by group or others and not sticky (mode {mode:04o})"
            ),
        }
    }
}
