//! Two hosts on one machine, for the tests of what crosses a network: two network
//! namespaces joined by a veth pair (`ip netns`, iproute2; root), each process run there
//! under a hostname of its own (`unshare --uts`), so that nothing takes a same-host path.
//! Each host's `/etc/hosts` (`/etc/netns/<namespace>/hosts`, which `ip netns exec` puts in
//! its place) maps its own name to 127.0.1.1, as Debian's and Ubuntu's do, and the other's
//! to its address on the link.

use std::path::PathBuf;
use std::process::Command;

/// The two hosts, removed when dropped.
pub struct Hosts {
    namespaces: [String; 2],
}

impl Hosts {
    /// Each host's name.
    pub const NAMES: [&'static str; 2] = ["node-a", "node-b"];
    /// Each host's address on the link between them.
    pub const ADDRS: [&'static str; 2] = ["10.77.0.1", "10.77.0.2"];

    /// Two fresh hosts, named after `tag` and this process (so that tests running at once
    /// each have their own); panics saying what is missing where they cannot be made.
    pub fn new(tag: &str) -> Self {
        let id = std::process::id() % 100_000;
        let namespaces = [0, 1].map(|h| format!("zt{id}{tag}{h}"));
        let hosts = Self { namespaces };
        for ns in &hosts.namespaces {
            hosts.ip(&["netns", "add", ns]);
        }
        let links = [format!("zv{id}{}a", &tag[..1]), format!("zv{id}{}b", &tag[..1])];
        hosts.ip(&["link", "add", &links[0], "type", "veth", "peer", "name", &links[1]]);
        for (h, link) in links.iter().enumerate() {
            let ns = &hosts.namespaces[h];
            hosts.ip(&["link", "set", link, "netns", ns]);
            hosts.ip(&["-n", ns, "addr", "add", &format!("{}/24", Self::ADDRS[h]), "dev", link]);
            hosts.ip(&["-n", ns, "link", "set", link, "up"]);
            hosts.ip(&["-n", ns, "link", "set", "lo", "up"]);
            let table = format!(
                "127.0.0.1 localhost\n127.0.1.1 {}\n{} {}\n",
                Self::NAMES[h],
                Self::ADDRS[1 - h],
                Self::NAMES[1 - h]
            );
            std::fs::create_dir_all(hosts.etc(h)).unwrap();
            std::fs::write(hosts.etc(h).join("hosts"), table).unwrap();
        }
        hosts
    }

    fn etc(&self, host: usize) -> PathBuf {
        PathBuf::from("/etc/netns").join(&self.namespaces[host])
    }

    fn ip(&self, args: &[&str]) {
        let out = Command::new("ip").args(args).output().expect("iproute2's ip (apt-get install iproute2)");
        assert!(out.status.success(), "ip {args:?} (needs root): {}", String::from_utf8_lossy(&out.stderr));
    }

    /// `program` with `args`, to be run as a process of host `host`.
    pub fn command(&self, host: usize, program: &str, args: &[&str]) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.namespaces[host], "unshare", "--uts", "sh", "-c"]);
        command.arg(format!("hostname {} && exec \"$0\" \"$@\"", Self::NAMES[host]));
        command.arg(program).args(args);
        command
    }

    /// The namespace of host `host` (for a program that enters it itself: MPI's remote
    /// shell; the launcher's tests go through [`command`](Self::command) alone).
    #[allow(dead_code, reason = "used by the MPI tests, not by every crate that includes this file")]
    pub fn namespace(&self, host: usize) -> &str {
        &self.namespaces[host]
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for h in 0..2 {
            // Removing a namespace removes its end of the link, and so the link.
            let _ = Command::new("ip").args(["netns", "del", &self.namespaces[h]]).status();
            let _ = std::fs::remove_dir_all(self.etc(h));
        }
    }
}
