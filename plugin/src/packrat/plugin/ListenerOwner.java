package packrat.plugin;

import java.io.IOException;
import java.net.InetAddress;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.List;

/**
 * Who listens on a TCP port of this machine, so that the plugin sends the management key only
 * to a controller of its own user.
 *
 * <p>Why: while the controller is down, any local user may bind its port (8085 is above 1024)
 * and would receive the management key with the next {@code /packrat/...} call. Linux lists
 * every socket of the network namespace with the uid that created it in {@code /proc/net/tcp}
 * and {@code /proc/net/tcp6}, readable by every user, so the plugin can tell who would answer
 * before it connects: no change to the controller and none to TorchServe 0.12.
 */
final class ListenerOwner {

    /** What {@link #check} answers when nothing listens (the controller is not running). */
    static final String NOBODY = "nothing listens there";

    /** The kernel's TCP_LISTEN state in the {@code st} column. */
    private static final String LISTEN = "0A";

    private static final int ROOT = 0;

    private final Path procNet;
    private final Path procSelfStatus;

    ListenerOwner(Path procNet, Path procSelfStatus) {
        this.procNet = procNet;
        this.procSelfStatus = procSelfStatus;
    }

    static ListenerOwner system() {
        return new ListenerOwner(Paths.get("/proc/net"), Paths.get("/proc/self/status"));
    }

    /**
     * null if something listens where a connection to {@code address:port} lands and every such
     * socket belongs to this process's user (or root, who can read the key file anyway); {@link
     * #NOBODY} if nothing listens there; else why the key must not go there.
     *
     * @throws IOException if /proc cannot be read (not Linux): then nobody can tell
     */
    String check(InetAddress address, int port) throws IOException {
        int own = effectiveUid();
        List<Integer> uids = listenerUids(address, port);
        if (uids.isEmpty()) {
            return NOBODY;
        }
        for (int uid : uids) {
            if (uid != own && uid != ROOT) {
                return "the socket listening there belongs to uid " + uid + ", not to this"
                        + " TorchServe's user (uid " + own + ")";
            }
        }
        return null;
    }

    /**
     * The uids of the listening sockets a connection to {@code address:port} could reach: those
     * bound to that address (an IPv4-mapped IPv6 one included) or to the wildcard address.
     */
    List<Integer> listenerUids(InetAddress address, int port) throws IOException {
        List<Integer> uids = new ArrayList<>();
        for (String table : new String[] {"tcp", "tcp6"}) {
            List<String> lines;
            try {
                lines = Files.readAllLines(procNet.resolve(table), StandardCharsets.US_ASCII);
            } catch (NoSuchFileException e) {
                continue; // a kernel without IPv6 has no tcp6
            }
            for (String line : lines.subList(Math.min(1, lines.size()), lines.size())) {
                // sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
                String[] f = line.trim().split("\\s+");
                if (f.length < 8 || !LISTEN.equals(f[3])) {
                    continue;
                }
                int colon = f[1].indexOf(':');
                if (colon < 0 || Integer.parseInt(f[1].substring(colon + 1), 16) != port) {
                    continue;
                }
                InetAddress local = InetAddress.getByAddress(addressBytes(f[1].substring(0, colon)));
                // Java maps ::ffff:a.b.c.d to the IPv4 address, so equals() covers that form too.
                if (local.isAnyLocalAddress() || local.equals(address)) {
                    uids.add(Integer.parseInt(f[7]));
                }
            }
        }
        return uids;
    }

    /**
     * The kernel prints an address as 32-bit words in host byte order (4 bytes for tcp, 16 for
     * tcp6): reversed within each word on a little-endian machine.
     */
    static byte[] addressBytes(String hex) {
        byte[] b = new byte[hex.length() / 2];
        for (int i = 0; i < b.length; i++) {
            b[i] = (byte) Integer.parseInt(hex.substring(2 * i, 2 * i + 2), 16);
        }
        if (ByteOrder.nativeOrder() == ByteOrder.LITTLE_ENDIAN) {
            for (int w = 0; w + 4 <= b.length; w += 4) {
                byte t = b[w];
                b[w] = b[w + 3];
                b[w + 3] = t;
                t = b[w + 1];
                b[w + 1] = b[w + 2];
                b[w + 2] = t;
            }
        }
        return b;
    }

    /** The effective uid, from the {@code Uid:} line (real, effective, saved, filesystem). */
    int effectiveUid() throws IOException {
        for (String line : Files.readAllLines(procSelfStatus, StandardCharsets.US_ASCII)) {
            if (line.startsWith("Uid:")) {
                return Integer.parseInt(line.substring(4).trim().split("\\s+")[1]);
            }
        }
        throw new IOException(procSelfStatus + " has no Uid: line");
    }
}
