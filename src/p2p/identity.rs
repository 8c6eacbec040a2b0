//! Ed25519 identity keys on disk, so a restarted node keeps its peer id.

use std::fs;
use std::io::Write;
use std::path::Path;

use libp2p::identity::Keypair;

use super::P2pError;

/// Loads the keypair at `path`, or creates one there (mode 0600, parent directories as needed)
/// when the file does not exist. The file holds libp2p's protobuf keypair encoding.
pub fn load_or_create(path: &Path) -> Result<Keypair, P2pError> {
    match fs::read(path) {
        Ok(bytes) => Keypair::from_protobuf_encoding(&bytes).map_err(|e| P2pError::Identity {
            path: path.to_owned(),
            detail: format!("not a libp2p keypair: {e}"),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = Keypair::generate_ed25519();
            let bytes = key.to_protobuf_encoding().map_err(|e| P2pError::Identity {
                path: path.to_owned(),
                detail: e.to_string(),
            })?;
            write_private(path, &bytes).map_err(|e| P2pError::Identity {
                path: path.to_owned(),
                detail: format!("cannot write: {e}"),
            })?;
            Ok(key)
        }
        Err(e) => Err(P2pError::Identity {
            path: path.to_owned(),
            detail: format!("cannot read: {e}"),
        }),
    }
}

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir)?;
    }
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_once_then_reloaded() {
        let dir = std::env::temp_dir().join(format!("hivemesh-id-{}", std::process::id()));
        let path = dir.join("sub").join("node.key");
        let _ = fs::remove_dir_all(&dir);
        let a = load_or_create(&path).unwrap();
        let b = load_or_create(&path).unwrap();
        assert_eq!(a.public().to_peer_id(), b.public().to_peer_id());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        fs::write(&path, b"garbage").unwrap();
        assert!(matches!(
            load_or_create(&path),
            Err(P2pError::Identity { .. })
        ));
        let _ = fs::remove_dir_all(&dir);
    }
}
