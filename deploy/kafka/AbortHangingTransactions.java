// Finds, and with "abort" aborts, hanging transactions (KIP-664) on the given topics' partitions:
// a producer's transaction is open on a partition (its last stable offset stops there) but the
// producer's transaction coordinator does not count that transaction as in progress there, so no
// marker will ever come and every read_committed consumer of the partition stops at it for good
// (a broker's halt on a full disk left one: docs/faults.md). Kafka's Admin describeProducers,
// listTransactions, describeTransactions and abortTransaction, which librdkafka does not offer.
// Run with the broker's jars:
//   java -cp "<kafka lib>/*" AbortHangingTransactions.java <client.properties> <min-age-ms> <check|abort> \
//       <transactional-id prefix> <topic>... [+<shared topic>...]
// A shared topic's partitions (e.g. +__consumer_offsets, where a transaction's offsets wait) hold
// other users' producers too: a hanging transaction there is aborted only when its producer id and
// epoch also hang on one of the topics named without "+", or its transactional id starts with the
// prefix.
// An open transaction is hanging when its last write is at least min-age-ms old (past every
// transaction timeout the producers use, after which the coordinator itself would have aborted a
// transaction it knew) and its coordinator lists no transaction of that producer id and epoch in
// progress on the partition (Ongoing with that epoch; a Prepare state with that epoch or the next).
// Prints one line per open transaction:
//   "open <topic> <partition> producer <id> epoch <e> from offset <o> age <ms>: <state> on its coordinator"
//   "hanging <...>: aborted" | "...: would abort" | "...: abort failed: <why>" | "...: another user's (left alone)"
// then "checked <n> partitions". Exit 1 if an abort failed; any error before (a coordinator still
// loading, an unknown topic) ends it with an exception and aborts nothing.
import java.io.FileInputStream;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.concurrent.TimeUnit;

import org.apache.kafka.clients.admin.AbortTransactionSpec;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.DescribeProducersResult.PartitionProducerState;
import org.apache.kafka.clients.admin.ListTransactionsOptions;
import org.apache.kafka.clients.admin.ProducerState;
import org.apache.kafka.clients.admin.TopicDescription;
import org.apache.kafka.clients.admin.TransactionDescription;
import org.apache.kafka.clients.admin.TransactionListing;
import org.apache.kafka.clients.admin.TransactionState;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.TopicPartitionInfo;

public class AbortHangingTransactions {
    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        try (FileInputStream in = new FileInputStream(args[0])) {
            props.load(in);
        }
        long minAgeMs = Long.parseLong(args[1]);
        boolean abort = args[2].equals("abort");
        String prefix = args[3];
        List<String> topics = new ArrayList<>();
        Set<String> shared = new HashSet<>();
        for (int i = 4; i < args.length; i++) {
            String name = args[i].startsWith("+") ? args[i].substring(1) : args[i];
            topics.add(name);
            if (args[i].startsWith("+")) {
                shared.add(name);
            }
        }
        boolean ok = true;
        try (Admin admin = Admin.create(props)) {
            List<TopicPartition> partitions = new ArrayList<>();
            for (TopicDescription d : admin.describeTopics(topics).allTopicNames().get(60, TimeUnit.SECONDS).values()) {
                for (TopicPartitionInfo p : d.partitions()) {
                    partitions.add(new TopicPartition(d.name(), p.partition()));
                }
            }
            Map<TopicPartition, List<ProducerState>> open = new HashMap<>();
            Set<Long> producerIds = new HashSet<>();
            for (Map.Entry<TopicPartition, PartitionProducerState> e :
                    admin.describeProducers(partitions).all().get(60, TimeUnit.SECONDS).entrySet()) {
                for (ProducerState s : e.getValue().activeProducers()) {
                    if (s.currentTransactionStartOffset().isPresent()) {
                        open.computeIfAbsent(e.getKey(), k -> new ArrayList<>()).add(s);
                        producerIds.add(s.producerId());
                    }
                }
            }
            Map<Long, TransactionDescription> coordinators = new HashMap<>();
            Map<Long, String> transactionalIds = new HashMap<>();
            if (!producerIds.isEmpty()) {
                List<String> ids = new ArrayList<>();
                for (TransactionListing l : admin.listTransactions(new ListTransactionsOptions().filterProducerIds(producerIds))
                        .all().get(60, TimeUnit.SECONDS)) {
                    ids.add(l.transactionalId());
                    transactionalIds.put(l.producerId(), l.transactionalId());
                }
                if (!ids.isEmpty()) {
                    for (TransactionDescription d : admin.describeTransactions(ids).all().get(60, TimeUnit.SECONDS).values()) {
                        coordinators.put(d.producerId(), d);
                    }
                }
            }
            long now = System.currentTimeMillis();
            // Producer id and epoch of every transaction hanging on a topic of our own.
            Set<String> ours = new HashSet<>();
            for (Map.Entry<TopicPartition, List<ProducerState>> e : open.entrySet()) {
                for (ProducerState s : e.getValue()) {
                    if (!shared.contains(e.getKey().topic()) && hanging(coordinators.get(s.producerId()), e.getKey(), s, now, minAgeMs)) {
                        ours.add(s.producerId() + "/" + s.producerEpoch());
                    }
                }
            }
            for (Map.Entry<TopicPartition, List<ProducerState>> e : open.entrySet()) {
                TopicPartition tp = e.getKey();
                for (ProducerState s : e.getValue()) {
                    long age = now - s.lastTimestamp();
                    String what = String.format("%s %d producer %d epoch %d from offset %d age %d", tp.topic(), tp.partition(),
                        s.producerId(), s.producerEpoch(), s.currentTransactionStartOffset().getAsLong(), age);
                    TransactionDescription d = coordinators.get(s.producerId());
                    boolean mine = !shared.contains(tp.topic()) || ours.contains(s.producerId() + "/" + s.producerEpoch())
                        || transactionalIds.getOrDefault(s.producerId(), "").startsWith(prefix);
                    if (!hanging(d, tp, s, now, minAgeMs)) {
                        String state = d == null ? "no transaction" : d.state() + " epoch " + d.producerEpoch();
                        System.out.println("open " + what + ": " + state + " on its coordinator");
                    } else if (!mine) {
                        System.out.println("hanging " + what + ": another user's (left alone)");
                    } else if (!abort) {
                        System.out.println("hanging " + what + ": would abort");
                    } else {
                        try {
                            AbortTransactionSpec spec = new AbortTransactionSpec(
                                tp, s.producerId(), (short) s.producerEpoch(), s.coordinatorEpoch().orElse(-1));
                            admin.abortTransaction(spec).all().get(60, TimeUnit.SECONDS);
                            System.out.println("hanging " + what + ": aborted");
                        } catch (Exception ex) {
                            ok = false;
                            Throwable cause = ex.getCause() != null ? ex.getCause() : ex;
                            System.out.println("hanging " + what + ": abort failed: " + cause.getMessage());
                        }
                    }
                }
            }
            System.out.println("checked " + partitions.size() + " partitions");
        }
        System.exit(ok ? 0 : 1);
    }

    static boolean hanging(TransactionDescription d, TopicPartition tp, ProducerState s, long now, long minAgeMs) {
        return now - s.lastTimestamp() >= minAgeMs && !inProgress(d, tp, s);
    }

    /** The coordinator counts this producer's transaction as in progress on `tp`. */
    static boolean inProgress(TransactionDescription d, TopicPartition tp, ProducerState s) {
        if (d == null || !d.topicPartitions().contains(tp)) {
            return false;
        }
        TransactionState state = d.state();
        if (state == TransactionState.ONGOING) {
            return d.producerEpoch() == s.producerEpoch();
        }
        boolean preparing = state == TransactionState.PREPARE_COMMIT || state == TransactionState.PREPARE_ABORT
            || state == TransactionState.PREPARE_EPOCH_FENCE;
        // Transactions v2 (KIP-890) bump the epoch as the transaction ends.
        return preparing && (d.producerEpoch() == s.producerEpoch() || d.producerEpoch() == s.producerEpoch() + 1);
    }
}
