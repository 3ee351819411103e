package packrat.plugin;

import io.netty.handler.codec.http.HttpHeaders;
import io.netty.handler.codec.http.HttpMessage;
import java.io.IOException;
import java.io.OutputStream;
import java.lang.reflect.Field;
import java.net.ConnectException;
import java.net.InetAddress;
import java.net.URI;
import java.net.URISyntaxException;
import java.net.http.HttpClient;
import java.net.http.HttpConnectTimeoutException;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.net.http.HttpTimeoutException;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.Properties;
import org.pytorch.serve.servingsdk.Context;
import org.pytorch.serve.servingsdk.ModelServerEndpoint;
import org.pytorch.serve.servingsdk.annotations.Endpoint;
import org.pytorch.serve.servingsdk.annotations.helpers.EndpointTypes;
import org.pytorch.serve.servingsdk.http.Request;
import org.pytorch.serve.servingsdk.http.Response;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Packrat's REST API on TorchServe's management address: {@code /packrat/...} is forwarded to
 * the Packrat controller on loopback ({@code /packrat/X} to {@code /v1/X}, {@code
 * /packrat/metrics} to {@code /metrics}) and the controller's status, body and content type are
 * returned unchanged.
 *
 * <p>Authorisation: TorchServe 0.12 puts its management-token check in front of every
 * management-port handler, plugins included (ServerInitializer: TokenAuthorizationHandler,
 * then ManagementRequestHandler, which dispatches to plugins). A call without the management
 * key is refused there and never reaches this class. The caller's Authorization header is
 * forwarded, and the controller checks it again against the same key file. It is forwarded
 * only to a listener of TorchServe's own user ({@link ListenerOwner}): while the controller is
 * down another local user could take its port and collect the key.
 *
 * <p>A call's JSON body goes in the {@link #BODY_HEADER} header (why: see there).
 *
 * <p>TorchServe runs plugin calls on its worker-manager's cached thread pool, not on a Netty
 * event loop, so the blocking forward below does not stall other connections.
 */
@Endpoint(
        urlPattern = "packrat",
        endpointType = EndpointTypes.MANAGEMENT,
        description = "Packrat controller API (live plans), forwarded to the controller on loopback")
public class PackratEndpoint extends ModelServerEndpoint {

    /** config.properties key: the controller's base URL; must be a loopback address. */
    static final String URL_KEY = "packrat_controller_url";

    static final String DEFAULT_URL = "http://127.0.0.1:8085";
    /**
     * Request header that carries a call's JSON body. TorchServe 0.12 runs a plugin on a thread
     * pool after its Netty handler has returned, and that handler (SimpleChannelInboundHandler
     * with auto-release) frees the request's body as it returns: reading the body races with
     * that release (IllegalReferenceCountException when the release wins; both outcomes seen).
     * Headers are plain strings and survive. So the plugin never reads a body, and refuses a
     * call that has one rather than forward it only sometimes.
     */
    static final String BODY_HEADER = "X-Packrat-Body";

    private static final String PREFIX = "/packrat";
    private static final Logger logger = LoggerFactory.getLogger(PackratEndpoint.class);

    // A refused connection on loopback fails at once; the timeout only bounds a hung controller.
    private static final HttpClient CLIENT =
            HttpClient.newBuilder()
                    .version(HttpClient.Version.HTTP_1_1) // no h2c upgrade attempt on plain http
                    .connectTimeout(Duration.ofSeconds(5))
                    .followRedirects(HttpClient.Redirect.NEVER)
                    .build();
    // A synchronous apply waits for the new version's workers to load: minutes for big models.
    private static final Duration REQUEST_TIMEOUT = Duration.ofMinutes(30);

    // The SDK's Request has header names but no values; TorchServe 0.12's implementation
    // (servingsdk.impl.ModelServerRequest) keeps the Netty request in this private field.
    private static final Field NETTY_REQUEST = nettyRequestField();

    @Override
    public void doGet(Request req, Response rsp, Context ctx) throws IOException {
        forward("GET", req, rsp, ctx);
    }

    @Override
    public void doPost(Request req, Response rsp, Context ctx) throws IOException {
        forward("POST", req, rsp, ctx);
    }

    @Override
    public void doPut(Request req, Response rsp, Context ctx) throws IOException {
        forward("PUT", req, rsp, ctx);
    }

    @Override
    public void doDelete(Request req, Response rsp, Context ctx) throws IOException {
        forward("DELETE", req, rsp, ctx);
    }

    private void forward(String method, Request req, Response rsp, Context ctx) throws IOException {
        String base = controllerUrl(ctx.getConfig());
        String problem = checkLoopback(base);
        if (problem != null) {
            error(rsp, 503, "ControllerUnavailable", problem);
            return;
        }
        if (refusedListener(base, rsp)) {
            return;
        }
        String target;
        try {
            target = targetPath(req.getRequestURI());
        } catch (URISyntaxException e) {
            error(rsp, 400, "BadRequest", "malformed request URI: " + e.getMessage());
            return;
        }
        HttpHeaders headers = headersOf(req);
        if (headers == null) {
            error(rsp, 500, "PluginError",
                    "this TorchServe version does not let the Packrat plugin read request headers"
                            + " (built for TorchServe 0.12); use the controller's own port");
            return;
        }
        // The JSON body travels in a header: see BODY_HEADER.
        String json = headers.get(BODY_HEADER);
        String length = headers.get("Content-Length");
        if (json == null
                && (headers.contains("Transfer-Encoding")
                        || (length != null && !"0".equals(length.trim())))) {
            error(rsp, 400, "BodyNotSupported",
                    "TorchServe 0.12 frees a request's body before an endpoint plugin can read it"
                            + " (pytorch/serve#2595), so /packrat/... takes the JSON in the "
                            + BODY_HEADER + " header instead of the body, e.g. curl -X POST -H '"
                            + BODY_HEADER + ": {\"batch\": 4}' .../packrat/models/M/plan. The"
                            + " controller's own port takes it as the body.");
            return;
        }
        HttpRequest.Builder out =
                HttpRequest.newBuilder(URI.create(base + target))
                        .timeout(REQUEST_TIMEOUT)
                        .method(method, json == null
                                ? HttpRequest.BodyPublishers.noBody()
                                // Netty decoded the header bytes as ISO-8859-1: this gives them back as sent.
                                : HttpRequest.BodyPublishers.ofByteArray(
                                        json.getBytes(StandardCharsets.ISO_8859_1)));
        if (json != null) {
            out.header("Content-Type", "application/json");
        }
        for (String name : new String[] {"Authorization", "Accept"}) {
            String value = headers.get(name);
            if (value != null) {
                out.header(name, value);
            }
        }
        HttpResponse<byte[]> answer;
        try {
            answer = CLIENT.send(out.build(), HttpResponse.BodyHandlers.ofByteArray());
        } catch (ConnectException | HttpConnectTimeoutException e) {
            unreachable(rsp, base, reason(e));
            return;
        } catch (HttpTimeoutException e) {
            error(rsp, 504, "ControllerTimeout",
                    "Packrat controller at " + base + " did not answer within "
                            + REQUEST_TIMEOUT.toMinutes() + " min");
            return;
        } catch (IOException e) {
            error(rsp, 502, "ControllerError",
                    "Packrat controller at " + base + " failed mid-request: " + reason(e));
            return;
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            error(rsp, 503, "ControllerUnavailable", "interrupted while calling the controller");
            return;
        }
        rsp.setStatus(answer.statusCode());
        answer.headers().firstValue("Content-Type").ifPresent(rsp::setContentType);
        answer.headers().firstValue("WWW-Authenticate")
                .ifPresent(v -> rsp.setHeader("WWW-Authenticate", v));
        try (OutputStream os = rsp.getOutputStream()) {
            os.write(answer.body());
        }
    }

    /**
     * true if the key must not go to whoever listens at {@code base} (nothing, another user's
     * socket, or nobody can tell), with the 503 written; false if the controller may be called.
     */
    private static boolean refusedListener(String base, Response rsp) throws IOException {
        URI uri = URI.create(base);
        String why;
        try {
            int port = uri.getPort() == -1 ? 80 : uri.getPort();
            why = ListenerOwner.system().check(InetAddress.getByName(hostOf(uri)), port);
        } catch (IOException | RuntimeException e) {
            error(rsp, 503, "ControllerNotVerified",
                    "cannot tell who listens at " + base + " (" + reason(e) + "), so the management"
                            + " key is not sent there: the plugin reads Linux's /proc/net/tcp. Use"
                            + " the controller's own port.");
            return true;
        }
        if (why == null) {
            return false;
        }
        if (ListenerOwner.NOBODY.equals(why)) {
            unreachable(rsp, base, why);
            return true;
        }
        logger.warn("Packrat controller at {} not trusted: {}", base, why);
        error(rsp, 503, "ControllerNotTrusted",
                "Packrat controller at " + base + " not trusted: " + why + ". The management key"
                        + " is not sent to it. Another user may have taken the port while the"
                        + " controller was down: stop that process and start the controller, or"
                        + " set " + URL_KEY + " in config.properties to where it listens.");
        return true;
    }

    private static void unreachable(Response rsp, String base, String why) throws IOException {
        logger.warn("Packrat controller not reachable at {}: {}", base, why);
        error(rsp, 503, "ControllerUnavailable",
                "Packrat controller not reachable at " + base + " (" + why + "). Start it"
                        + " with `packrat controller` (or `make run`), or set " + URL_KEY
                        + " in config.properties to where it listens. TorchServe itself keeps"
                        + " serving.");
    }

    /** {@code /packrat/X?q} to {@code /v1/X?q}, {@code /packrat/metrics} to {@code /metrics}; raw (still encoded). */
    static String targetPath(String requestUri) throws URISyntaxException {
        URI uri = new URI(requestUri);
        String path = uri.getRawPath() == null ? "" : uri.getRawPath();
        // TorchServe routes here on the first path segment, so the path starts with /packrat.
        String rest = path.startsWith(PREFIX) ? path.substring(PREFIX.length()) : path;
        String mapped = "/metrics".equals(rest) ? rest : "/v1" + rest;
        return uri.getRawQuery() == null ? mapped : mapped + "?" + uri.getRawQuery();
    }

    static String controllerUrl(Properties config) {
        String url = config.getProperty(URL_KEY);
        url = url == null || url.isBlank() ? DEFAULT_URL : url.trim();
        return url.endsWith("/") ? url.substring(0, url.length() - 1) : url;
    }

    /**
     * null if {@code base} is an http URL on a loopback address, else why not: the caller's
     * management key travels with every call and must not leave the machine in clear text.
     */
    static String checkLoopback(String base) {
        try {
            URI uri = new URI(base);
            if (!"http".equals(uri.getScheme()) || uri.getHost() == null) {
                return URL_KEY + "=" + base + " is not an http://host:port URL";
            }
            if (!InetAddress.getByName(hostOf(uri)).isLoopbackAddress()) {
                return URL_KEY + "=" + base + " is not a loopback address; the plugin only"
                        + " forwards to a controller on this machine";
            }
            return null;
        } catch (URISyntaxException | IOException e) {
            return URL_KEY + "=" + base + " is not a valid URL: " + e.getMessage();
        }
    }

    /** The URI's host without an IPv6 literal's brackets. */
    private static String hostOf(URI uri) {
        String host = uri.getHost();
        return host.startsWith("[") && host.endsWith("]") ? host.substring(1, host.length() - 1) : host;
    }

    private static Field nettyRequestField() {
        try {
            Field f = Class.forName("org.pytorch.serve.servingsdk.impl.ModelServerRequest")
                    .getDeclaredField("req");
            f.setAccessible(true);
            return f;
        } catch (ReflectiveOperationException | RuntimeException e) {
            logger.error("Packrat plugin cannot read request headers on this TorchServe", e);
            return null;
        }
    }

    private static HttpHeaders headersOf(Request req) {
        if (NETTY_REQUEST == null || !NETTY_REQUEST.getDeclaringClass().isInstance(req)) {
            return null;
        }
        try {
            return ((HttpMessage) NETTY_REQUEST.get(req)).headers();
        } catch (ReflectiveOperationException | ClassCastException e) {
            return null;
        }
    }

    private static String reason(Exception e) {
        if (e.getMessage() != null) {
            return e.getMessage();
        }
        return e instanceof ConnectException ? "connection refused" : e.getClass().getSimpleName();
    }

    private static String jsonEscape(String s) {
        StringBuilder b = new StringBuilder(s.length() + 16);
        for (char c : s.toCharArray()) {
            if (c == '"' || c == '\\') {
                b.append('\\').append(c);
            } else if (c < 0x20) {
                b.append(String.format("\\u%04x", (int) c));
            } else {
                b.append(c);
            }
        }
        return b.toString();
    }

    /** The JSON shape TorchServe's own errors have: {"code", "type", "message"}. */
    private static void error(Response rsp, int code, String type, String message)
            throws IOException {
        rsp.setStatus(code);
        rsp.setContentType("application/json");
        String json = "{\"code\": " + code + ", \"type\": \"" + type + "\", \"message\": \""
                + jsonEscape(message) + "\"}";
        try (OutputStream os = rsp.getOutputStream()) {
            os.write(json.getBytes(StandardCharsets.UTF_8));
        }
    }
}
